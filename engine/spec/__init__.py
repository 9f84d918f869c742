"""Speculative decoding: proposers, the lossless verification rule, and adaptive draft length."""

from engine.spec.config import SpecConfig, parse_spec

__all__ = ["SpecConfig", "parse_spec"]
