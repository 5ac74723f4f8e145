"""What a model asks of the runtime besides ModelOps: the op mixins it calls and how its steps
may be run. Every model class declares `traits`; a model whose needs depend on its config
(a dense or an MoE llama) sets its own in __init__."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelTraits:
    # The op mixins (MoEOps, MLAOps, DeepSeekV4Ops) the model calls beyond ModelOps: the runner
    # refuses a backend whose ops do not inherit one of them.
    ops: tuple[type, ...] = ()
    # It can be built with mtp=True: a multi-token-prediction layer drafts for speculative
    # decoding (draft_forward, draft_logits).
    mtp_draft: bool = False
    # Drafts a verify step may hold: the model can undo what only so many rejected drafts did
    # to its state. None: no limit.
    max_speculative_tokens: int | None = None
    # Keeps per-sequence state in the cache's state slots, which a verify step saves before
    # and rewinds after (save_carry, rewind_carry).
    stateful: bool = False
    # Its data path reads every KV group's tables and the state slots from the step metadata:
    # backends hand it their grouped metadata.
    reads_group_meta: bool = False
    # Its decode step reads device tensors only: a CUDA graph can hold it.
    graph_decode: bool = False


def missing_ops(traits: ModelTraits, ops: object) -> list[type]:
    """The mixins traits.ops names that `ops` does not inherit."""
    return [mixin for mixin in traits.ops if not isinstance(ops, mixin)]


class Float32Params:
    """Mixed into a module whose parameters named in fp32_params stay float32 whatever the
    model's dtype (the runner restores them after the cast)."""

    fp32_params: tuple[str, ...] = ()
