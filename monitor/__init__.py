"""Collectors for local GPUs, the engine and remote servers (no Qt)."""
