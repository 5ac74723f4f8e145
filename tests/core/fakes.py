"""A fake backend whose 'model' reads its context back through the block tables.

Each token's id is written into the slot the scheduler chose; the next token is a fixed
function of the context read back through the block table. A dense reference applies the same
function to the plain token list, so any paging, prefix-hit or preemption mistake shows up as
different tokens.
"""
from __future__ import annotations

import json
import os

import torch

from deepinfer.core.accelerator import Accelerator
from deepinfer.core.batch import ModelBatch, SamplerOutput
from deepinfer.core.config import CacheConfig, ModelSpec

VOCAB = 97


def next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context[-4:])) + len(context)) % VOCAB


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


class PagedFakeAccelerator(Accelerator):
    name = "fake"

    def __init__(self, num_blocks: int | None = None) -> None:
        self.fixed_blocks = num_blocks
        self.slots = torch.empty(0)
        self.steps: list[ModelBatch] = []

    def load_model(self, spec: ModelSpec) -> None:
        pass

    def num_kv_blocks(self, cache: CacheConfig) -> int:
        return self.fixed_blocks or cache.num_blocks or 64

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.slots = torch.full((num_blocks * block_size,), -1, dtype=torch.long)

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        self.steps.append(batch)
        bs = batch.block_size
        for t, slot in enumerate(batch.slot_mapping):
            assert slot >= bs, "the null block must never be written"
            self.slots[slot] = batch.input_ids[t]
        tokens = []
        for i in batch.sample_indices:
            table, seq_len = batch.block_tables[i], batch.seq_lens[i]
            context = [int(self.slots[table[p // bs] * bs + p % bs]) for p in range(seq_len)]
            assert -1 not in context, "read a slot that was never written"
            tokens.append(next_token(context))
        return SamplerOutput(tokens, [None] * len(tokens))
