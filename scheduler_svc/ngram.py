"""N-gram prompt lookup: draft tokens from a sequence's own tokens, costing no model.

The last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min) are looked up among its
earlier tokens; where they occurred last, the tokens that followed are the draft. Text that copies or
rewrites spans of its prompt (quotes, summaries, code edits) continues the way it did there.

Each sequence keeps an index of its n-grams (n-gram -> the position after its latest occurrence), extended
by the tokens that arrived since the last lookup, so a lookup costs a few dict probes, not a scan.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("_ends", "_indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        # n-gram (a tuple of n token ids) -> position right after its latest indexed occurrence.
        self._ends: dict[tuple[int, ...], int] = {}
        # n-grams ending before position _indexed are in _ends.
        self._indexed = 0

    def propose(self, tokens: list[int], k: int, skip: int = 0) -> list[int]:
        """Up to k tokens to follow tokens[-1] and then `skip` unknown tokens (a token in flight: its guess
        is the first continuation token, dropped), from the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of at least min_n tokens occurred before."""
        end = len(tokens) - 1  # the suffix itself ends at `end` and is not indexed yet
        self._extend(tokens, end)
        ends = self._ends
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = ends.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + skip : start + skip + k]
        return []

    def _extend(self, tokens: list[int], end: int) -> None:
        ends = self._ends
        lo, hi = self.min_n, self.max_n
        for i in range(self._indexed, end):
            # n-grams ending at token i (inclusive), the latest occurrence winning.
            for n in range(lo, min(hi, i + 1) + 1):
                ends[tuple(tokens[i + 1 - n : i + 1])] = i + 1
        self._indexed = max(self._indexed, end)
