"""What the MTP tests of DeepSeek-V3 and -V4 share: a speculator whose drafts are known (the
real step runs, the draft layer computes and writes its KV, then the proposals are replaced by
plain decoding's own tokens, the one at draft position `wrong`, if any, made wrong), and the
draft layer's logits of one prompt on the CPU backend."""
from __future__ import annotations

from typing import Callable

import torch

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.backends.torch.speculative import MTPSpeculator
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import ModelSpec
from deepinfer.core.kv.spec import KVSpec


class OracleSpeculator(MTPSpeculator):
    def __init__(self, inner: MTPSpeculator, outputs: dict[tuple, list[int]],
                 wrong: int | None, vocab_size: int) -> None:
        super().__init__(inner.runner, inner.make_meta)
        self.outputs, self.wrong, self.vocab_size = outputs, wrong, vocab_size

    def _propose(self, batch, meta, positions, hidden, rows):
        real = super()._propose(batch, meta, positions, hidden, rows)
        return [self._oracle(row, sampled, len(p))
                for row, sampled, p in zip(batch.sampling, rows, real)]

    def _oracle(self, row, sampled, count: int) -> list[int]:
        done = len(row.output_token_ids) + len(sampled.token_ids)
        right = self.outputs[tuple(row.prompt_token_ids)][done:done + count]
        if self.wrong is not None and len(right) > self.wrong:
            right[self.wrong] = (right[self.wrong] + 1) % self.vocab_size
        return right


def prefill_batch(prompt: list[int], table: list[int], block_size: int, spec: KVSpec,
                  state_slots: list[int]) -> ModelBatch:
    """The whole prompt as one sequence in the pages `table` (every KV group alike)."""
    n = len(prompt)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    groups = tuple(GroupBatch([table], slots) for _ in spec.groups)
    return ModelBatch(prompt, list(range(n)), [n], [n], groups, [0], [], state_slots)


def cpu_draft_logits(path: str, prompt: list[int], nxt: int, blocks: int, block_size: int,
                     make_batch: Callable[[KVSpec], ModelBatch], state_slots: int = 0
                     ) -> torch.Tensor:
    """The draft layer's logits at every prompt position, `nxt` the token after the prompt."""
    acc = CPUAccelerator()
    acc.init_device()
    acc.runner.num_speculative_tokens = 1
    info = acc.load_model(ModelSpec(path, dtype="float32"))
    batch = make_batch(info.kv_spec)
    acc.allocate_kv_cache(blocks, block_size, num_state_slots=state_slots)
    model, meta = acc.runner.model, acc._meta(batch)
    positions = torch.arange(len(prompt))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), positions, meta)
        shifted = torch.tensor(prompt[1:] + [nxt])
        return model.draft_logits(model.draft_forward(shifted, positions, hidden, meta))
