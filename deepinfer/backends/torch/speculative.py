"""One speculative decoding step on the torch runner: verify, then propose.

1. The model runs every query token (prefill chunks, and each decode's last token followed by
   its drafts) and samples at each decode's last k + 1 positions; core/speculative.py keeps the
   longest run of drafts equal to the model's own choices and the model's token after it.
   A model with per-request state (DeepSeek-V4's compressors) saves what drafts may
   overwrite before the forward and rewinds it after, for the rejected ones.
2. The draft layer (the model's MTP layer) runs over the same tokens with the same attention
   metadata: at position p it reads the model's hidden state there and the token at p + 1. This
   writes its KV for every computed position; past the last accepted token the entries are
   garbage, never read before the next step rewrites them. Its output at the last accepted
   position gives the first proposal.
3. Each further proposal is one more draft-layer step on its own previous output, one token
   per sequence, at the next position (the scheduler reserved those slots).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.core.batch import GroupBatch, ModelBatch, SampledRow, SamplerOutput, SpecBatch
from deepinfer.core.speculative import accept, as_decode_rows, verify_rows
from deepinfer.core.transfer import tensor_on


class MTPSpeculator:
    def __init__(self, runner: TorchRunner, make_meta: Callable[[ModelBatch], Any]) -> None:
        self.runner, self.make_meta = runner, make_meta

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        # A step of decodes with k drafts each runs as decode rows: the batched decode path.
        meta = self.make_meta(as_decode_rows(batch) or batch)
        positions = self._tensor(batch.positions)
        self.runner.begin_step(batch.num_tokens, batch.num_real_tokens)
        saved = self._save_carry(batch)
        hidden = self.runner.forward(self._tensor(batch.input_ids), positions, meta)
        rows = self._verify(batch, hidden)
        self._rewind_carry(batch, rows, saved)
        prompt = self.runner.prompt_logprobs(hidden, batch)
        if not any(_spec(batch).num_proposals):
            return SamplerOutput.from_rows(rows, prompt)
        proposals = self._propose(batch, meta, positions, hidden, rows)
        return SamplerOutput.from_rows([dataclasses.replace(row, proposals=p)
                                        for row, p in zip(rows, proposals)], prompt)

    @property
    def block_size(self) -> int:
        """Tokens per block: the KV pool's (PagedCache owns it)."""
        return self.runner.cache.block_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return tensor_on(values, self.runner.device)

    def _verify(self, batch: ModelBatch, hidden: torch.Tensor) -> list[SampledRow]:
        drafts = _spec(batch).draft_token_ids
        ends = _query_ends(batch)
        at = [p for i, d in zip(batch.sample_indices, drafts)
              for p in range(ends[i] - len(d), ends[i] + 1)]
        logits = self.runner.logits(hidden[self._tensor(at)])
        sampled = self.runner.sample(logits, verify_rows(batch.sampling, drafts))
        return accept(sampled, drafts)

    # ---- models with state (DeepSeek-V4's compressors) ------------------------------------
    def _drafting(self, batch: ModelBatch) -> list[int]:
        """The sampled rows that verify drafts."""
        return [r for r, d in enumerate(_spec(batch).draft_token_ids) if d]

    def _save_carry(self, batch: ModelBatch) -> Any:
        model = self.runner.model
        if not model.traits.stateful or not batch.state_slots:
            return None
        seqs = [batch.sample_indices[r] for r in self._drafting(batch)]
        return model.save_carry([batch.state_slots[i] for i in seqs])

    def _rewind_carry(self, batch: ModelBatch, rows: list[SampledRow], saved: Any) -> None:
        """Undo what the rejected drafts' positions did to the state slots."""
        if saved is None:
            return
        ends, slots, kept, verified = _query_ends(batch), [], [], []
        for r in self._drafting(batch):
            i, drafts = batch.sample_indices[r], _spec(batch).draft_token_ids[r]
            last = batch.positions[ends[i]]  # the last draft's position
            slots.append(batch.state_slots[i])
            kept.append(last - len(drafts) + len(rows[r].token_ids))
            verified.append(last + 1)
        self.runner.model.rewind_carry(saved, slots, kept, verified)

    # ---- proposals -----------------------------------------------------------------------
    def _propose(self, batch: ModelBatch, meta: Any, positions: torch.Tensor,
                 hidden: torch.Tensor, rows: list[SampledRow]) -> list[list[int]]:
        model = self.runner.model
        shifted = self._tensor(_next_tokens(batch, rows))
        draft_hidden = model.draft_forward(shifted, positions, hidden, meta)
        last = _last_accepted(batch, rows)
        counts = [self._room(batch, r, batch.positions[i]) for r, i in enumerate(last)]
        state = draft_hidden[self._tensor(last)]
        tokens = model.draft_logits(state).argmax(dim=-1)
        proposals = [[t] if c else [] for t, c in zip(tokens.tolist(), counts)]
        for j in range(2, max(counts) + 1):
            active = [r for r, c in enumerate(counts) if c >= j]
            at = [batch.positions[last[r]] + j - 1 for r in active]
            index = self._tensor(active)
            step = _step_batch(batch, [batch.sample_indices[r] for r in active], at,
                               self.block_size)
            out = model.draft_forward(tokens[index], self._tensor(at), state[index],
                                      self.make_meta(step))
            state[index], tokens[index] = out, model.draft_logits(out).argmax(dim=-1)
            for r, t in zip(active, tokens[index].tolist()):
                proposals[r].append(t)
        return proposals

    def _room(self, batch: ModelBatch, row: int, last_position: int) -> int:
        """Proposals for a row: as asked, while proposal j's draft step (at last_position +
        j - 1) has a slot and the next step can verify it (at last_position + 1 + j)."""
        seq = batch.sample_indices[row]
        slots = min(len(g.block_tables[seq]) for g in batch.groups) * self.block_size
        fits = min(slots - last_position, self.runner.model_info.max_model_len - 2 - last_position)
        return max(0, min(_spec(batch).num_proposals[row], fits))


def _spec(batch: ModelBatch) -> SpecBatch:
    """The drafts of a step the engine built for a speculating model (every step of it)."""
    if batch.spec is None:
        raise ValueError("a speculative step carries its drafts (ModelBatch.spec)")
    return batch.spec


def _query_ends(batch: ModelBatch) -> list[int]:
    """Per sequence, the index of its last query token in the flat token list."""
    ends, end = [], -1
    for q in batch.query_lens:
        end += q
        ends.append(end)
    return ends


def _next_tokens(batch: ModelBatch, rows: list[SampledRow]) -> list[int]:
    """Per token of the step, the token at the next position: the query's own next token, the
    chunk's next prompt token, or for sampled sequences the step's accepted tokens from the
    last real query token on (past them, anything: those draft entries are never read)."""
    shifted = batch.input_ids[1:] + [0]
    ends = _query_ends(batch)
    for i, token in enumerate(_spec(batch).next_token_ids):
        shifted[ends[i]] = token
    for i, row, drafts in zip(batch.sample_indices, rows, _spec(batch).draft_token_ids):
        rejected = len(drafts) + 1 - len(row.token_ids)
        shifted[ends[i] - len(drafts):ends[i] + 1] = row.token_ids + row.token_ids[-1:] * rejected
    return shifted


def _last_accepted(batch: ModelBatch, rows: list[SampledRow]) -> list[int]:
    """Per sampled row, the flat index of its last accepted token (the draft layer's output
    there proposes the token after the model's own)."""
    ends = _query_ends(batch)
    return [ends[i] - len(d) + len(row.token_ids) - 1
            for i, row, d in zip(batch.sample_indices, rows, _spec(batch).draft_token_ids)]


def _step_batch(batch: ModelBatch, seqs: list[int], positions: list[int], bs: int,
                writes: list[bool] | None = None) -> ModelBatch:
    """A one-token-per-sequence step at `positions` of the given sequences, over their
    block tables (a draft-layer step; nothing sampled). A sequence whose `writes` is False
    writes its KV into the null block (slot 0): it runs only to keep a graph's batch whole."""
    writes = writes or [True] * len(seqs)
    groups = tuple(GroupBatch([g.block_tables[i] for i in seqs],
                              [g.block_tables[i][p // bs] * bs + p % bs if w else 0
                               for i, p, w in zip(seqs, positions, writes)])
                   for g in batch.groups)
    state = [batch.state_slots[i] for i in seqs] if batch.state_slots else []
    return ModelBatch([0] * len(seqs), positions, [1] * len(seqs), [p + 1 for p in positions],
                      groups, [], [], state)
