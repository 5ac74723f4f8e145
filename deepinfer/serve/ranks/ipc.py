"""Messages between the API process and a rank's engine process (pickled over ZMQ).

Only what changed crosses the wire: a request once, then per step the new tokens and text.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.request import RequestTimes
from deepinfer.core.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefix_cache: bool = True
    # The client reads the whole answer at its end (a non-streaming request): the rank sends
    # a sample's first token (time to first token) and then the rest when it ends.
    final_only: bool = False
    client: int = 0  # the API process that sent it (--api-server-count): its results go there
    # The constraint's grammar as the API process's grammar workers compiled it
    # (CompiledGrammar.serialize_json); None where it sent none and the rank compiles.
    grammar: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Control:
    """A command answered with a ControlReply of the same id (reset cache, stats, shutdown)."""

    command: str
    call_id: int
    client: int = 0  # the API process waiting for the reply


@dataclass(frozen=True)
class ControlReply:
    call_id: int
    result: object


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs]
    num_prompt_tokens: int
    num_cached_tokens: int
    # SamplingParams.prompt_logprobs: the prompt's entries (None first), on a sample's first
    # delta only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    times: RequestTimes | None = None  # a finished sample's moments on the rank's clock

    def then(self, later: "TokenDelta") -> "TokenDelta":
        """This delta and the next one of the same sample as one delta."""
        return TokenDelta.joined([self, later])

    @staticmethod
    def joined(deltas: list["TokenDelta"]) -> "TokenDelta":
        """Consecutive deltas of one sample as one (the last one's state), each list copied
        once however many there are."""
        last = deltas[-1]
        if len(deltas) == 1:
            return last
        return dataclasses.replace(
            last, new_token_ids=[t for d in deltas for t in d.new_token_ids],
            new_text="".join(d.new_text for d in deltas),
            logprobs=[lp for d in deltas for lp in d.logprobs],
            prompt_logprobs=next((d.prompt_logprobs for d in deltas
                                  if d.prompt_logprobs is not None), None))


@dataclass(frozen=True)
class RequestError:
    """The engine refused a request (status 400: bad input it could only check there) or
    failed it (500: a fault while serving it; its batch mates went on)."""

    request_id: str
    message: str
    status: int = 400


@dataclass(frozen=True)
class Heartbeat:
    """Sent by a rank's heartbeat thread every interval, whatever its step loop is doing: no
    heartbeat means the process is stopped or wedged; a step that stays busy too long means
    the loop is stuck."""

    rank: int
    pid: int
    steps: int  # steps taken so far
    busy_s: float  # how long the step in progress has run (0.0 between steps)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    dummy_steps: int = 0  # lockstep ranks: steps run only to match a busy peer's collectives
    # Of `waiting`, those held for their grammar (vLLM's "deferred"); the rest wait for room.
    waiting_deferred: int = 0
    # Tokens per step (core/histogram.py CountHistogram over STEP_TOKEN_BOUNDS): running totals.
    step_token_counts: tuple[int, ...] = ()
    step_tokens_sum: int = 0
    # HiCache (host tier) of this rank; all 0 when it is off. Totals except the page gauges.
    hicache_pages_used: int = 0
    hicache_pages_total: int = 0
    hicache_pages_pinned: int = 0
    hicache_shared: bool = False  # the node's shared pool: its page gauges are the node's
    hicache_lookups: int = 0
    hicache_device_hit_tokens: int = 0
    hicache_host_hit_tokens: int = 0
    hicache_stored_pages: int = 0
    hicache_loaded_pages: int = 0
    hicache_evicted_pages: int = 0
    hicache_load_bytes: int = 0
    hicache_store_bytes: int = 0
    hicache_load_seconds: float = 0.0
    hicache_store_seconds: float = 0.0
    # HiCache's disk tier (core/hicache/disk.py DiskStats); all 0 when it is off. Gauges:
    # pages, bytes_used, capacity_bytes, write_queue, write_stopped; the rest totals.
    hicache_disk_pages: int = 0
    hicache_disk_bytes_used: int = 0
    hicache_disk_capacity_bytes: int = 0
    hicache_disk_write_queue: int = 0
    hicache_disk_write_stopped: int = 0
    hicache_disk_written_pages: int = 0
    hicache_disk_write_bytes: int = 0
    hicache_disk_write_seconds: float = 0.0
    hicache_disk_write_errors: int = 0
    hicache_disk_write_dropped: int = 0
    hicache_disk_read_pages: int = 0
    hicache_disk_read_bytes: int = 0
    hicache_disk_read_seconds: float = 0.0
    hicache_disk_corrupt_pages: int = 0
    hicache_disk_evicted_pages: int = 0
    hicache_disk_unawaited_prefetches: int = 0
    # Speculative decoding (core/speculative.py SpecDecodeStats): k (0: off), then totals.
    spec_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Accelerator.region_times(): {region: {"seconds": s, "calls": n}}; empty when not timed.
    regions: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    rank: int
    deltas: list[TokenDelta] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats | None = None


@dataclass(frozen=True)
class ExpertStats:
    """A rank's MoE view, sent at most once a second and after each EPLB rebalance: tokens it
    routed to each expert of each MoE layer since start, and its rebalances."""

    rank: int
    load: list[list[int]]  # [MoE layer][expert]
    rebalances: int = 0
    last_rebalance: object = None  # models.moe.runtime.RebalanceReport of the latest one


@dataclass(frozen=True)
class Ready:
    rank: int
    num_blocks: int
    block_size: int
    max_model_len: int
    accelerator: str
    hicache_pages: int = 0  # host-tier pages of block_size tokens (0: HiCache off)
    stats: EngineStats | None = None  # so an idle rank shows in the per-rank metrics at once
    # The tokenizer facts a grammar is compiled against (its bitmask size, its stop tokens).
    vocab_size: int = 0
    stop_token_ids: tuple[int, ...] = ()
    rebind_group: bool = False  # Capabilities.rebind_group: it can stay through a regroup


@dataclass(frozen=True)
class Regroup:
    """To the surviving ranks of an expert-parallel group that lost a rank: drop every request
    (the API process failed them), leave the old torch.distributed group and join a new one
    with the replacement at `master_port`, taking `placement_from`'s expert placement; then
    report Ready again. The model and the KV pool stay."""

    master_port: int
    placement_from: int
    timeout_s: float  # the new group's: the replacement joins after its backoff and start


@dataclass(frozen=True)
class RankEvent:
    """What became of a rank, from API process 0 (which alone starts and watches the ranks)
    to the other API processes (--api-server-count); also their start-up snapshot."""

    rank: int
    state: str  # a RankState value
    spawn: int  # which start of the rank (its input addresses carry it)
    pid: int | None
    exitcode: int | None = None
    reason: str = ""  # why it died, when it did
    restarts: int = 0
    lost_requests: int = 0  # process 0's requests it took down


@dataclass(frozen=True)
class Failed:
    rank: int
    error: str
