"""Finding the request that broke a step, so that only it fails.

When `execute` raises for a whole batch, the batch is cut in halves and each half run again,
down to single sequences. Running a sequence again is safe: it writes the same K/V into the
same slots and samples with the same (seed, step) noise, so the survivors get exactly the
tokens they would have had. A fault that follows no request (a broken device) fails every
single sequence, and the caller sees that too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from deepinfer.core.batch import SampledRow, SamplerOutput, TokenLogprobs
from deepinfer.core.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class IsolatedStep:
    """What re-running a failed step in parts gave: the sequences that ran with their samples
    (in the step's order) and the ones that fail on their own, with their errors."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    rows: list[SampledRow] = field(default_factory=list)  # one per sampled sequence
    # Prompt logprobs by id() of the sequence that scored them (its index changes per part).
    prompt: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    failed: list[tuple[ScheduledSeq, BaseException]] = field(default_factory=list)

    def survivors(self, keep: Callable[[ScheduledSeq], bool]
                  ) -> tuple[SchedulerOutput, SamplerOutput]:
        """The step without the sequences `keep` drops (e.g. siblings of a failed request)."""
        out, rows, prompt = SchedulerOutput(), [], {}
        samples = iter(self.rows)
        for seq in self.seqs:
            row = next(samples) if seq.sampled else None
            if keep(seq):
                if id(seq) in self.prompt:
                    prompt[len(out.seqs)] = self.prompt[id(seq)]
                out.seqs.append(seq)
                if row is not None:
                    rows.append(row)
        return out, SamplerOutput.from_rows(rows, prompt)


def isolate(execute: Callable[[SchedulerOutput], SamplerOutput],
            seqs: list[ScheduledSeq]) -> IsolatedStep:
    """Run `seqs` in halves until every part either runs or is one sequence that fails."""
    result = IsolatedStep()
    _run(execute, seqs, result)
    return result


def _run(execute: Callable[[SchedulerOutput], SamplerOutput], seqs: list[ScheduledSeq],
         result: IsolatedStep) -> None:
    try:
        sampled = execute(SchedulerOutput(list(seqs)))
    except Exception as exc:  # noqa: BLE001 - any fault is narrowed down to its request
        if len(seqs) == 1:
            result.failed.append((seqs[0], exc))
            return
        half = len(seqs) // 2
        _run(execute, seqs[:half], result)
        _run(execute, seqs[half:], result)
        return
    result.seqs.extend(seqs)
    result.rows.extend(sampled.rows())
    result.prompt.update({id(seqs[i]): entries for i, entries in sampled.prompt_logprobs.items()})
