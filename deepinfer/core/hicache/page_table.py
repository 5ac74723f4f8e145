"""The shared pool's index: an open-addressing hash table from a page's hash-chain hash to its
page id, over two arrays in shared memory (keys uint64, values int32), so every rank of a node
reads and updates the same table (under the pool's lock).

Linear probing with backward-shift deletion (no tombstones: a table that lives as long as the
server never fills up with them). A key is the hash's first 8 bytes with its low bit set (0
marks an empty slot); a hit is confirmed by the caller's `holds(page, block_hash)`, which
compares the page's own record, so a key collision or an entry a dead rank left half-written
is at worst a miss.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from deepinfer.core.kv.hashing import BlockHash


def table_slots(num_pages: int) -> int:
    """Slots for num_pages entries at a load factor of at most 1/2 (a power of two)."""
    return 1 << max(4, (2 * num_pages - 1).bit_length())


class PageTable:
    def __init__(self, keys: np.ndarray, values: np.ndarray,
                 holds: Callable[[int, BlockHash], bool]) -> None:
        if len(keys) != len(values) or len(keys) & (len(keys) - 1):
            raise ValueError("a page table needs as many keys as values, a power of two")
        self.keys, self.values, self.holds = keys, values, holds
        self.mask = len(keys) - 1
        # The probe loop's scalars as Python ints (numpy scalar reads cost several times more).
        self._keys = keys.data.cast("B").cast("Q")
        self._values = values.data.cast("B").cast("i")

    @staticmethod
    def key(block_hash: BlockHash) -> int:
        return int.from_bytes(block_hash[:8], "little") | 1

    def find(self, block_hash: BlockHash) -> int:
        """The page block_hash's entry names (confirmed by `holds`), or -1."""
        slot = self._slot(block_hash)
        return -1 if slot < 0 else self._values[slot]

    def _slot(self, block_hash: BlockHash) -> int:
        key, keys, values, mask = self.key(block_hash), self._keys, self._values, self.mask
        i = key & mask
        while (k := keys[i]) != 0:
            if k == key and self.holds(values[i], block_hash):
                return i
            i = (i + 1) & mask
        return -1

    def insert(self, block_hash: BlockHash, page: int) -> None:
        key = self.key(block_hash)
        i = key & self.mask
        while self._keys[i] != 0:
            i = (i + 1) & self.mask
        self._values[i], self._keys[i] = page, key  # the key last: a probe sees it whole

    def remove(self, block_hash: BlockHash, page: int) -> None:
        """Drop block_hash's entry if it names `page`."""
        i = self._slot(block_hash)
        if i >= 0 and self._values[i] == page:
            self._delete(i)

    def _delete(self, i: int) -> None:
        """Empty slot i, moving later entries of its probe run back."""
        keys, values, mask = self._keys, self._values, self.mask
        j = i
        while True:
            j = (j + 1) & mask
            k = keys[j]
            if k == 0:
                break
            home = k & mask
            # Entry j may fill the hole at i if its home is not within (i, j] cyclically.
            if (i <= j and not i < home <= j) or (i > j and j < home <= i):
                keys[i], values[i] = k, values[j]
                i = j
        keys[i] = 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self.keys))
