"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the tail.

The engine asks an NgramIndex (one per sequence); the scans below are the definition it is
tested against."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens continuing the longest tail n-gram (n_max..n_min) seen earlier in `tokens`.

    The most recent earlier match wins: in copy-heavy text the latest occurrence is the one
    being copied. A deterministic proposer, so verification treats its draft as p_draft = 1.
    """
    paths = propose_ngram_paths(tokens, k, n_max, n_min, 1)
    return paths[0] if paths else []


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
            _add_path(paths, tokens[start + n : start + n + k])
            if len(paths) == branches:
                return paths
    return paths


def _add_path(paths: list[list[int]], follow: list[int]) -> None:
    if follow and not any(p[: len(follow)] == follow for p in paths):
        paths.append(follow)


class NgramIndex:
    """propose_ngram and propose_ngram_paths for one sequence's growing tokens, from an index of
    where each of its n-grams started, kept up as tokens are appended: a lookup is a dictionary
    read instead of a scan of the whole context (45 us at 100 tokens, 140 at 300 and 500 at
    1,000 for a tail found nowhere, each step, on the 2-core EPYC), so it can be asked for every
    decoding sequence before drafts are priced. Its answers are the scans' (tested).

    The scans match an n-gram against those starting at most size - n - 1, that is every n-gram
    but those ending at the last token; so the index holds the n-grams ending before it."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts, ascending
        self.size = 0  # tokens seen (their n-grams ending before the last are indexed)

    def _update(self, tokens: list[int]) -> None:
        """Index the n-grams `tokens` added. Each call's tokens must start with the last call's
        (a sequence's only grow; checking them all would cost what the scan did, O(length) a
        step); fewer than before start the index over."""
        done = self.size
        if done > len(tokens):
            self.starts, done = {}, 0
        for end in range(max(0, done - 1), len(tokens) - 1):  # n-grams ending at `end`
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)
        self.size = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """propose_ngram(tokens, k, n_max, n_min)."""
        paths = self.paths(tokens, k, 1)
        return paths[0] if paths else []

    def paths(self, tokens: list[int], k: int, branches: int) -> list[list[int]]:
        """propose_ngram_paths(tokens, k, n_max, n_min, branches)."""
        self._update(tokens)
        size, paths = len(tokens), []
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            for start in reversed(self.starts.get(tuple(tokens[size - n :]), ())):
                _add_path(paths, tokens[start + n : start + n + k])
                if len(paths) == branches:
                    return paths
        return paths
