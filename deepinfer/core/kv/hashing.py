"""Hash chain over full pages: h_i = H(h_{i-1}, tokens of page i, extra key).

A page's hash commits to every token before it, so equal hashes mean equal prefixes up to a
collision; hits still compare the page's own tokens so a collision can never serve wrong KV.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids_of: Callable[[int, int], Sequence[int]],
                        num_tokens: int, block_size: int, extra: bytes = b"") -> None:
    """Append hashes for every page that is full within the first num_tokens tokens.

    `token_ids_of(start, end)` returns the tokens of that range; `extra` salts the first page
    only, since the chain carries it onward.
    """
    while (len(hashes) + 1) * block_size <= num_tokens:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        tokens = token_ids_of(i * block_size, (i + 1) * block_size)
        hashes.append(hash_block(parent, tokens, extra if i == 0 else b""))
