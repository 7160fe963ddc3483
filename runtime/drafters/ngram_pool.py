"""Lookahead's n-gram pool: for each first token, up to G continuations, least recently used evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NGramPool:
    """Maps a key token to at most `capacity` distinct continuations of `length` tokens.

    An n-gram (key, c1, ..., c_{n-1}) is stored under its first token. Adding one that
    is already there refreshes it; adding a new one to a full key evicts that key's
    least recently added or refreshed continuation.
    """

    def __init__(self, length: int, capacity: int):
        self.length, self.capacity = length, capacity
        self._map: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        cont = tuple(int(t) for t in continuation)
        if len(cont) != self.length:
            raise ValueError(f"continuation of {len(cont)} tokens; this pool holds {self.length}")
        slot = self._map.setdefault(int(key), OrderedDict())
        if cont in slot:
            slot.move_to_end(cont)
            return
        slot[cont] = None
        if len(slot) > self.capacity:
            slot.popitem(last=False)

    def add_ngrams(self, tokens: Sequence[int], start: int = 0) -> None:
        """Every n-gram (length + 1 tokens) of `tokens` that starts at index >= start, in order."""
        n = self.length + 1
        for i in range(max(0, start), len(tokens) - n + 1):
            self.add(tokens[i], tokens[i + 1 : i + n])

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of `key`, most recently used first."""
        slot = self._map.get(int(key))
        return list(reversed(slot)) if slot else []

    def __len__(self) -> int:
        return sum(len(s) for s in self._map.values())

    def __contains__(self, key: int) -> bool:
        return int(key) in self._map and bool(self._map[int(key)])
