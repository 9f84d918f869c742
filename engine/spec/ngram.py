"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the tail."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens continuing the longest tail n-gram (n_max..n_min) seen earlier in `tokens`.

    The most recent earlier match wins: in copy-heavy text the latest occurrence is the one
    being copied. A deterministic proposer, so verification treats its draft as p_draft = 1.
    """
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def propose_ngram_paths(tokens: list[int], k: int, n_max: int, n_min: int,
                        branches: int) -> list[list[int]]:
    """Up to `branches` different continuations (k tokens at most each) of earlier occurrences of
    the tail n-gram, the branches of a draft tree: the longest n-grams first, the most recent
    occurrence first within each, so the first path is propose_ngram's. A continuation that
    repeats one already taken, or is a start of one, adds nothing and is skipped."""
    size = len(tokens)
    paths: list[list[int]] = []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] != tail:
                continue
            follow = tokens[start + n : start + n + k]
            if follow and not any(p[: len(follow)] == follow for p in paths):
                paths.append(follow)
                if len(paths) == branches:
                    return paths
    return paths
