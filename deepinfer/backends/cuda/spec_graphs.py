"""CUDA graphs for speculative decoding's steady state: every sequence decodes and verifies
the configured k drafts (a step of decode rows, core/speculative.as_decode_rows).

Launched one by one, the draft layer's few hundred kernels cost more than the tokens it saves;
so three graph sets, each a graphs.DecodeGraphs over the backend's own row layout:

- verify, k + 1 rows per sequence: the model over every row, logits of every row (the sampler
  and the acceptance read them), the hidden states left in a static buffer;
- draft, the same rows with each id replaced by the token after it: the draft layer (MTP)
  over that buffer, its argmax per row, its output states in a second buffer;
- step, one row per sequence: one more draft-layer step from a state buffer, for drafts
  2..k, the state replaced by the step's output.

Between them the host samples and accepts (core/speculative.py), rewinds the state of models
that have one (backends/torch/speculative.py), and fills the next graph's rows; when every
sequence decodes greedily the draft graph reads the verify graph's argmax on the device and
follows it without a host wait. A sequence with
fewer drafts (near max_tokens or the context's end) gets null rows after its own; a step
with prefill chunks runs eagerly, as MTPSpeculator does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.backends.cuda.graphs import DecodeGraphs, RowLayout
from deepinfer.backends.cuda.group_inputs import GroupedDecodeRows
from deepinfer.backends.cuda.step_inputs import StepInputs
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.backends.torch.speculative import (
    MTPSpeculator,
    _last_accepted,
    _next_tokens,
    _step_batch,
)
from deepinfer.core.batch import InputsFromLastStep, ModelBatch, SampledRow, SamplerOutput
from deepinfer.core.sampler import all_plain_greedy
from deepinfer.core.speculative import accept, as_decode_rows, run_rows, verify_rows


def _in_runs(layout: RowLayout, q: int) -> RowLayout:
    """The layout for rows in runs of q tokens of one sequence (models with state step them
    token by token; for the others rows are independent already)."""
    if isinstance(layout, GroupedDecodeRows):
        return dataclasses.replace(layout, tokens_per_seq=q)
    return layout


class GraphSpeculator(MTPSpeculator):
    def __init__(self, runner: TorchRunner, make_meta: Callable[[ModelBatch], Any],
                 num_drafts: int, max_num_seqs: int, layout: RowLayout,
                 device: torch.device) -> None:
        super().__init__(runner, make_meta)
        self.q = num_drafts + 1
        self.null_state_slot = (layout.null_state_slot
                                if isinstance(layout, GroupedDecodeRows) else 0)
        rows = max_num_seqs * self.q
        self.verify = DecodeGraphs(rows, _in_runs(layout, self.q), device)
        self.draft = DecodeGraphs(rows, _in_runs(layout, self.q), device)
        self.step = DecodeGraphs(max_num_seqs, layout, device) if num_drafts > 1 else None
        # Static buffers the graphs pass states through (sized at the largest bucket's
        # warm-up, before any capture).
        self.buffers: dict[str, torch.Tensor] = {}

    def capture(self) -> None:
        self.verify.capture(self._verify_forward)
        self.draft.capture(self._draft_forward)
        if self.step is not None:
            self.step.capture(self._step_forward)

    # ---- what the graphs hold ----------------------------------------------------------
    def _buffer(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A static buffer of at least `rows` rows shaped as `like`'s. On a GPU the largest
        bucket's warm-up sizes each before any capture; recording afresh (no GPU), it grows."""
        held = self.buffers.get(name)
        if held is None or held.shape[0] < rows:
            held = self.buffers[name] = like.new_zeros((rows, *like.shape[1:]))
        return held

    def _keep(self, name: str, value: torch.Tensor) -> None:
        self._buffer(name, value.shape[0], value)[:value.shape[0]].copy_(value)

    def _verify_forward(self, inputs: StepInputs, rows: int) -> torch.Tensor:
        if self.runner.moe is not None:
            self.runner.moe.padded_tokens = rows
        hidden = self.runner.forward(inputs.input_ids, inputs.positions, inputs.meta)
        self._keep("hidden", hidden)
        return self.runner.logits(hidden)

    def _draft_forward(self, inputs: StepInputs, rows: int) -> torch.Tensor:
        model = self.runner.model
        out = model.draft_forward(inputs.input_ids, inputs.positions,
                                  self.buffers["hidden"][:rows], inputs.meta)
        self._keep("draft", out)
        self._buffer("state", rows, out)  # the step graphs' input, sized before their capture
        return model.draft_logits(out)

    def _step_forward(self, inputs: StepInputs, rows: int) -> torch.Tensor:
        model, state = self.runner.model, self.buffers["state"][:rows]
        out = model.draft_forward(inputs.input_ids, inputs.positions, state, inputs.meta)
        state.copy_(out)
        return model.draft_logits(out)

    # ---- a step --------------------------------------------------------------------------
    def execute(self, batch: ModelBatch) -> SamplerOutput:
        # Sequences with fewer drafts (near max_tokens) are padded to k + 1 rows.
        rows = as_decode_rows(batch, self.q, self.null_state_slot)
        if rows is None or not self.verify.can_run(rows) or batch.prompt_logprobs:
            return super().execute(batch)
        index = run_rows(batch.query_lens, self.q)  # each token's row
        saved = self._save_carry(batch)
        self._set_step(rows, batch.num_tokens)
        logits, verified = self.verify.run(rows)
        proposing = any(batch.spec.num_proposals)
        greedy = all_plain_greedy(batch.sampling)
        # All greedy: the token after each row is the verify graph's own argmax there (an
        # accepted draft, the model's token after the last, or past it anything), so the
        # draft graph follows on the device, with no host wait in between.
        drafted = self._draft(rows, None) if greedy and proposing else None
        sampled = self._accept(batch, logits, verified, index, greedy)
        self._rewind_carry(batch, sampled, saved)
        if not proposing:
            return SamplerOutput.from_rows(sampled)
        if drafted is None:
            drafted = self._draft(rows, _shifted(batch, index, rows.num_tokens, sampled))
        proposals = self._propose_graphed(batch, index, sampled, drafted)
        return SamplerOutput.from_rows([dataclasses.replace(row, proposals=p)
                                        for row, p in zip(sampled, proposals)])

    def _set_step(self, rows: ModelBatch, num_real: int) -> None:
        """MoE models: the verify replay's size and how many of its rows are real (the load
        counts take the first num_real rows: where sequences have null rows between theirs,
        they are approximate). The draft layer's experts count in their own runtime."""
        if self.runner.moe is not None:
            self.runner.moe.set_step(self.verify.bucket_for(rows.num_seqs), num_real)

    def _accept(self, batch: ModelBatch, logits: torch.Tensor, verified: torch.Tensor,
                index: list[int], greedy: bool) -> list[SampledRow]:
        """The sampler (or, all greedy, the verify graph's own argmax) at each token's row,
        then the acceptance."""
        drafts, at = batch.spec.draft_token_ids, self._tensor(index)
        if greedy:
            tokens = verified[at].tolist()
            out = SamplerOutput(tokens, [None] * len(tokens))
        else:
            out = self.runner.sample(logits[at], verify_rows(batch.sampling, drafts))
        return accept(out, drafts)

    def _draft(self, rows: ModelBatch, shifted: list[int] | None) -> torch.Tensor:
        """The draft graph over the verified rows, each id the token after it (`shifted`, or
        None: the verify graph's argmax, read on the device); its argmax per row."""
        if shifted is None:
            every = list(range(rows.num_tokens))
            rows = dataclasses.replace(rows, from_last_step=InputsFromLastStep(
                every, every, _DeviceIds(self.verify.tokens)))
        else:
            rows = dataclasses.replace(rows, input_ids=shifted)
        return self.draft.run(rows)[1]

    def _propose_graphed(self, batch: ModelBatch, index: list[int], sampled: list[SampledRow],
                         drafted: torch.Tensor) -> list[list[int]]:
        """The draft graph's argmax at each sequence's last accepted token, then the
        draft-step graphs for drafts 2..k, each reading the previous one's argmax on the
        device: the host reads every proposal at the end, once."""
        last = _last_accepted(batch, sampled)
        counts = [self._room(batch, r, batch.positions[i]) for r, i in enumerate(last)]
        at = self._tensor([index[i] for i in last])  # the last accepted token's row
        ids = [drafted[at]]
        if max(counts) > 1:
            ids += self._further_drafts(batch, at, [batch.positions[i] for i in last], counts,
                                        ids[0])
        drafts = torch.stack(ids, dim=1).tolist()  # [sequence][j]
        return [row[:c] for row, c in zip(drafts, counts)]

    def _further_drafts(self, batch: ModelBatch, at: torch.Tensor, last_positions: list[int],
                        counts: list[int], first: torch.Tensor) -> list[torch.Tensor]:
        """Drafts 2..max(counts) of every sequence (rows past a sequence's count compute
        what nobody reads): the step graph from the draft layer's state at `at`, each row on
        its own previous draft."""
        draft = self.buffers["draft"]
        n = len(last_positions)
        self._buffer("state", self.step.bucket_for(n), draft)[:n].copy_(draft[at])
        every, out, previous = list(range(n)), [], first
        for j in range(2, max(counts) + 1):
            step = dataclasses.replace(
                _draft_step(batch, last_positions, counts, j, self.block_size),
                from_last_step=InputsFromLastStep(every, every, _DeviceIds(previous)))
            previous = self.step.run(step)[1][:n].clone()  # the next replay reuses the buffer
            out.append(previous)
        return out

@dataclass(frozen=True)
class _DeviceIds:
    """Ids a graph's rows read on the device (InputsFromLastStep.source)."""

    tokens: torch.Tensor


def _shifted(batch: ModelBatch, index: list[int], num_rows: int,
             sampled: list[SampledRow]) -> list[int]:
    """Per row, the token after it (backends/torch/speculative._next_tokens, placed in the runs)."""
    out = [0] * num_rows
    for row, token in zip(index, _next_tokens(batch, sampled)):
        out[row] = token
    return out


def _draft_step(batch: ModelBatch, last_positions: list[int], counts: list[int],
                j: int, block_size: int) -> ModelBatch:
    """Draft step j (j >= 2) of every sampled sequence, one row each at position last + j - 1.
    Rows that propose fewer drafts run too, at their last position (the graph's batch stays
    whole), and write their KV into the null block."""
    active = [c >= j for c in counts]
    positions = [p + j - 1 if a else p for p, a in zip(last_positions, active)]
    return _step_batch(batch, batch.sample_indices, positions, block_size, active)
