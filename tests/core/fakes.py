"""A fake backend whose 'model' reads its context back through the block tables.

Each token's id is written into the slot the scheduler chose; the next token is a fixed
function of the context read back through the block table. A dense reference applies the same
function to the plain token list, so any paging, prefix-hit or preemption mistake shows up as
different tokens. Its host tier (HiCache) moves slot contents page by page, so a page loaded
from the host into the wrong block, or never loaded, fails the same context check.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from deepinfer.core.accelerator import Accelerator, Capabilities, HostPoolLayout, ModelInfo
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, ModelSpec
from deepinfer.core.kv.spec import KVSpec, kv_heads_layer

VOCAB = 97
FAKE_PAGE_BYTES = 1 << 20  # so hicache_size_gb = n / 1024 gives exactly n host pages


def host_gb(num_pages: int) -> float:
    return num_pages * FAKE_PAGE_BYTES / (1 << 30)


def next_token(context: list[int], length: int | None = None) -> int:
    """A function of the last 4 tokens and the sequence length only."""
    length = len(context) if length is None else length
    return (sum(t * (i + 1) for i, t in enumerate(context[-4:])) + length) % VOCAB


def reference(prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def write_config(path: str, max_len: int = 4096) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["FakeForCausalLM"], "model_type": "llama",
                   "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 8,
                   "num_hidden_layers": 1, "num_attention_heads": 1,
                   "max_position_embeddings": max_len, "eos_token_id": 0}, f)
    return path


@dataclass
class FakeCopy:
    """An asynchronous copy that finishes only when the test says so; a deferred one moves
    its data only then (a store on a stream of its own reads its blocks when it runs)."""

    finished: bool = False
    run: Callable[[], None] | None = None

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finish()

    def finish(self) -> None:
        if not self.finished and self.run is not None:
            self.run()
        self.finished = True


class PagedFakeAccelerator(Accelerator):
    name = "fake"
    capabilities = Capabilities(host_page_copy=True)

    def __init__(self, num_blocks: int | None = None, state_bytes: int = 0,
                 async_copies: bool = False, window: int | None = None,
                 capabilities: Capabilities | None = None,
                 deferred_stores: bool = False) -> None:
        self.fixed_blocks = num_blocks
        # With a window, the 'model' is a sliding-window one: it reads only the last
        # `window` tokens (next_token needs 4), and the KV spec lets the manager free the rest.
        self.window = window
        if capabilities is not None:
            self.capabilities = capabilities
        self.slots = torch.empty(0)
        self.steps: list[ModelBatch] = []
        self.block_size = 0
        self.host = torch.empty(0)
        self.state_bytes = state_bytes  # > 0: describe a model that keeps per-request state
        self.host_state: dict[int, int] = {}  # state slot -> the token count it was saved at
        self.restored: list[tuple[str, int]] = []  # (request id, tokens) per state load
        self.async_copies = async_copies or deferred_stores
        self.deferred_stores = deferred_stores  # stores read their blocks when they finish
        self.copies: list[FakeCopy] = []
        self.copied_pages = {"to_device": 0, "to_host": 0}

    def load_model(self, spec: ModelSpec) -> ModelInfo:
        with open(os.path.join(spec.path, "config.json")) as f:
            max_len = json.load(f)["max_position_embeddings"]
        layer = kv_heads_layer(1, 1, self.window)
        return ModelInfo(vocab_size=VOCAB, eos_token_ids=(0,), max_model_len=max_len,
                         kv_spec=KVSpec((layer,)))

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        return self.fixed_blocks or cache.num_blocks or 64

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        self.slots = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.block_size = block_size

    def host_page_bytes(self) -> int:
        return FAKE_PAGE_BYTES

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0) -> HostPoolLayout:
        self.host = torch.full((num_pages, self.block_size), -1, dtype=torch.long)
        return HostPoolLayout(num_pages, FAKE_PAGE_BYTES, num_state_slots, self.state_bytes)

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[Sequence[int]],
                   to_device: bool) -> FakeCopy | None:
        (device_blocks,) = device_blocks  # one KV group
        assert len(host_pages) == len(device_blocks)
        pairs = list(zip(host_pages, device_blocks))
        self.copied_pages["to_device" if to_device else "to_host"] += len(host_pages)
        if self.deferred_stores and not to_device:
            handle = FakeCopy(run=lambda: self._move(pairs, to_device))
            self.copies.append(handle)
            return handle
        self._move(pairs, to_device)
        return self._handle()

    def _move(self, pairs: list[tuple[int, int]], to_device: bool) -> None:
        bs = self.block_size
        for page, block in pairs:
            if block == 0:  # a sliding window's freed page: left out where the backend can
                assert self.capabilities.host_copy_skips_null, "the null block was copied"
                continue
            dev = self.slots[block * bs:(block + 1) * bs]
            if to_device:
                assert -1 not in self.host[page].tolist(), "loaded a host page never stored"
                dev.copy_(self.host[page])
            else:
                assert -1 not in dev.tolist(), "stored a block that was never written"
                self.host[page].copy_(dev)

    def copy_state(self, host_slot: int, request_id: str, num_tokens: int,
                   to_device: bool) -> FakeCopy | None:
        assert self.state_bytes > 0, "copy_state called for a model without state"
        if to_device:
            assert self.host_state[host_slot] == num_tokens, "restored state of another point"
            self.restored.append((request_id, num_tokens))
        else:
            self.host_state[host_slot] = num_tokens
        return self._handle()

    def _handle(self) -> FakeCopy | None:
        if not self.async_copies:
            return None
        self.copies.append(FakeCopy())
        return self.copies[-1]

    def finish_copies(self) -> None:
        for copy in self.copies:
            copy.finish()

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        self.steps.append(batch)
        bs = self.block_size
        real = len(batch.slot_mapping) - sum(batch.query_lens[batch.num_seqs -
                                                               batch.num_padding_seqs:])
        for t, slot in enumerate(batch.slot_mapping[:real]):
            assert slot >= bs, "the null block must never be written"
            self.slots[slot] = batch.input_ids[t]
        tokens = []
        for i in batch.sample_indices:
            table, seq_len = batch.block_tables[i], batch.seq_lens[i]
            first = 0 if self.window is None else max(0, seq_len - self.window)
            context = [int(self.slots[table[p // bs] * bs + p % bs])
                       for p in range(first, seq_len)]
            assert -1 not in context, "read a slot that was never written"
            assert all(table[p // bs] != 0 for p in range(first, seq_len)), \
                "a visible key sits in the null block"
            tokens.append(next_token(context, seq_len))
        return SamplerOutput(tokens, [None] * len(tokens))
