"""The Accelerator seam: the one object the engine calls each step.

Hooks (plugins.py) are for discovery only; per-step work goes straight to the selected
Accelerator, so a backend is a plain class a plugin author can read top to bottom.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from deepinfer.core.kv.spec import KVSpec

if TYPE_CHECKING:
    from deepinfer.core.batch import ModelBatch, SamplerOutput
    from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data, so the neutral scheduler adapts without subclassing."""

    # Runs partial prefill chunks; without it a prompt is prefilled in one step or waits.
    chunked_prefill: bool = True
    # The KV pool is sized once and may never be outgrown: the scheduler admits a request only
    # when every block it can ever need (prompt + max_tokens) is free, so nothing is preempted.
    fixed_kv_pool: bool = False
    # Static-shape backends: the scheduler pads a step's token count up to one of
    # token_buckets, and a decode-only step's sequence count up to one of batch_buckets.
    # Padding rows are one token of the null block, never sampled.
    batch_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()
    # Implements host_page_bytes / allocate_host_pool / copy_pages (HiCache's host tier).
    host_page_copy: bool = False
    # copy_pages leaves group g of page i alone where device_blocks[g][i] is the null block (a
    # sliding-window group's page already out of its window); HiCache serves sliding-window
    # models (DeepSeek-V4, Mistral) only with it.
    host_copy_skips_null: bool = False
    # allocate_host_pool places its pages in a file every rank of the node maps (HiCache's
    # node-wide pool, core/hicache/shared_pool.py); without it each rank keeps its own pool.
    host_pool_shared: bool = False
    # Runs ModelBatch.spec steps (verify drafts, propose the next ones with the model's MTP
    # layer); the engine refuses num_speculative_tokens > 0 elsewhere.
    speculative_decoding: bool = False
    # launch() returns before the step's tokens reach the host, and takes input ids from the
    # step in flight (ModelBatch.from_last_step): the engine schedules and launches the next
    # step while this one runs (async scheduling).
    async_output: bool = False
    # Most prefill tokens in a step that also decodes (0: no cap), unless the scheduler config
    # sets prefill_beside_decodes: where a large chunk takes long next to a decode step (the
    # CPU), running streams would wait that long for each token while a prompt is prefilled.
    prefill_beside_decodes: int = 0
    # Implements rebind_group: an expert-parallel group that loses a rank is mended around the
    # survivors (they keep their model); without it the whole group restarts.
    rebind_group: bool = False
    # Computes ModelBatch.prompt_logprobs (the logits of scored prompt positions, besides
    # the sampled ones); the engine refuses requests with prompt_logprobs elsewhere.
    prompt_logprobs: bool = False
    # Activation dtypes the backend runs; a model asking for another is refused at load.
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # The step limits where the scheduler config leaves them unset: a GPU reads its weights
    # once for a step of hundreds of sequences and thousands of tokens, so it wants far larger
    # steps than a CPU, whose step time grows with every row.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class ModelInfo:
    """What the core needs to know of a loaded model; the backend's load_model returns it."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    kv_spec: KVSpec
    dtype: str = "float32"
    # Layers exchange data between ranks (expert parallel MoE): ranks must step together.
    needs_collectives: bool = False


@dataclass(frozen=True)
class ParallelContext:
    """A rank's place among its peers, given to init_device. `group` is a torch.distributed
    process group over all ranks (gloo on CPU, NCCL on CUDA, a plugin's own), or None when the
    ranks run independently."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    expert_parallel: bool = False
    # Extra expert slots beyond one per expert, for replicas of hot experts (EPLB).
    redundant_experts: int = 0
    # A regroup (a rank of a running group was replaced): the rank whose expert placement
    # every rank takes, as EPLB may have moved experts since the group started. None at a
    # first start, where every rank begins from the same static placement.
    placement_from: int | None = None


@dataclass(frozen=True)
class MemoryStats:
    device_total_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HostPoolLayout:
    """What a backend allocated for HiCache's host tier.

    Pages are ids 0..num_pages-1; one page holds one block_size-token KV block of every layer,
    stored page-first so a page moves as one large contiguous copy. State slots hold per-request
    layer state besides pages (sliding-window KV, compressor carry-over) for models that have it.
    """

    num_pages: int
    page_bytes: int
    num_state_slots: int = 0
    state_slot_bytes: int = 0  # 0: the model keeps no state besides its pages
    pinned: bool = False  # page-locked memory (fast asynchronous DMA)
    # The pages' bytes as host code sees them (page i at [i * page_bytes, (i + 1) *
    # page_bytes)), for the disk tier's file I/O; None where the host cannot address them.
    memory: memoryview | None = field(default=None, compare=False, repr=False)

    @property
    def stateful(self) -> bool:
        return self.state_slot_bytes > 0


class CopyHandle(Protocol):
    """An asynchronous copy in flight (a stream event on backends with streams)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class StepFuture(Protocol):
    """A launched step whose sampled tokens the host has not read yet."""

    def result(self) -> "SamplerOutput":
        """Wait for the step and return what it sampled."""
        ...


@dataclass(frozen=True)
class ReadyStep:
    """A step that ran to the end before launch() returned."""

    output: "SamplerOutput"

    def result(self) -> "SamplerOutput":
        return self.output


class Accelerator(ABC):
    """A backend. One instance per rank process.

    Lifecycle: init_device -> configure -> load_model -> num_kv_blocks -> allocate_kv_cache
    -> warm_up -> capture_graphs -> execute* -> shutdown.
    """

    name: str = "abstract"
    # Read by the engine after load_model: a static-shape backend may plan its buckets from
    # the model and the engine config.
    capabilities: Capabilities = Capabilities()
    # The torch.distributed backend of the rank group (gloo on CPU, nccl on CUDA, a plugin's).
    distributed_backend: str = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        """Cheap probe: can this backend run on this machine?"""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why is_available() said no, and what would make it yes: the message a user gets
        who asked for this backend by name."""
        return "its availability probe found no usable device"

    def init_device(self, parallel: ParallelContext = ParallelContext()) -> None:
        """Per-rank environment and device setup (pinning, threads, visible devices)."""

    def rebind_group(self, parallel: ParallelContext) -> None:
        """Take a new process group of the same ranks, in place of the one init_device gave
        (a peer rank died and was replaced; the old group is destroyed). The model, its
        weights and the KV pool stay. It must make the same collective calls, in the same
        order, as the replacement rank makes while it starts (init_device to
        capture_graphs). A backend that cannot keeps the default: the API process then
        restarts the whole group."""
        raise NotImplementedError(f"the {self.name} backend cannot take a new rank group")

    def configure(self, config: "EngineConfig") -> None:
        """Engine-wide settings, before load_model: the step limits (max_num_batched_tokens,
        max_num_seqs) that size memory profiling and captured graphs, enforce_eager."""

    @abstractmethod
    def load_model(self, spec: "ModelSpec") -> ModelInfo:
        """Build the model for `spec`, load its weights onto the device, say what it is."""

    @abstractmethod
    def num_kv_blocks(self, cache: "CacheConfig") -> int:
        """How many pages (one block of every KV group) fit in the memory budget."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          num_state_slots: int = 0) -> None:
        """Allocate num_blocks blocks in every KV group (block 0 is the null block, padding
        only) and, for models with per-request state, num_state_slots state slots. It only
        allocates: warm_up and capture_graphs follow."""

    def warm_up(self) -> None:
        """After allocate_kv_cache: compile or load what the first requests would otherwise
        wait for (kernels for each step shape), leaving the KV pool as allocated."""

    def capture_graphs(self) -> None:
        """After warm_up: record the graphs steps replay (CUDA graphs, a static-shape
        backend's compiled buckets); a backend without graphs keeps this no-op."""

    @abstractmethod
    def execute(self, batch: "ModelBatch") -> "SamplerOutput":
        """Run the model on the batch, sample one token per sampled sequence."""

    def launch(self, batch: "ModelBatch") -> StepFuture:
        """execute() without waiting for the tokens (Capabilities.async_output): the engine
        calls it only on steps whose rows need nothing but token ids back (no logprobs,
        penalties, grammars, drafts or prompt logprobs), and reads the result after launching the
        next step, whose batch may take input ids from this one (ModelBatch.from_last_step)."""
        return ReadyStep(self.execute(batch))

    # ---- HiCache host tier (optional; Capabilities.host_page_copy says a backend has it) ------
    def host_page_bytes(self) -> int:
        """Bytes of one host page (one block of every KV group), after allocate_kv_cache."""
        raise NotImplementedError(f"the {self.name} backend has no host page copy")

    def allocate_host_pool(self, num_pages: int, num_state_slots: int = 0,
                           shared_file: str | None = None) -> HostPoolLayout:
        """Allocate host memory for num_pages pages (pinned where the backend can). With
        shared_file (Capabilities.host_pool_shared), the pages are that file's bytes, mapped
        shared (num_pages x host_page_bytes(), made by the core): the other ranks of the node
        map the same file, and a page one rank stores another loads."""
        raise NotImplementedError(f"the {self.name} backend has no host page copy")

    def copy_pages(self, host_pages: Sequence[int], device_blocks: Sequence[Sequence[int]],
                   to_device: bool) -> CopyHandle | None:
        """Copy host_pages[i] <-> block device_blocks[g][i] of every KV group g (every chunk of
        the KV spec); with `Capabilities.host_copy_skips_null`, a null block (id 0) there means
        group g of that page is not copied. Backends with streams enqueue
        the copy on the engine stream, so later steps see it in order, and return a handle the
        caller polls before reusing the host pages; None means it is already done. A store
        (to_device False) reads pages computed by steps whose tokens the engine has already
        taken (result() of a launched step): it need not wait for a step launched since."""
        raise NotImplementedError(f"the {self.name} backend has no host page copy")

    def copy_state(self, host_slot: int, request_id: str, num_tokens: int,
                   to_device: bool) -> CopyHandle | None:
        """Models with state only: save (or restore) a request's layer state as of num_tokens
        tokens, a page boundary, to (from) a host state slot."""
        raise NotImplementedError(f"the {self.name} backend keeps no per-request state")

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(device_total_bytes=0, weights_bytes=0, kv_cache_bytes=0)

    def region_times(self) -> dict[str, dict[str, float]]:
        """Device time per named region of a step since start, {region: {"seconds": s,
        "calls": n}}, for backends that time them (the Neuron backend's
        DEEPINFER_NEURON_REGION_TIMING); empty otherwise."""
        return {}

    # ---- MoE (models with experts only) ----------------------------------------------------
    def expert_load(self) -> Any:
        """Host tensor [MoE layers, experts]: tokens this rank routed to each expert since
        start; None for a model without experts."""
        return None

    def rebalance_experts(self) -> Any:
        """EPLB, a collective over the expert-parallel group: a new expert placement from the
        group's recent load, weights moved between ranks. Returns a report with the stall and
        the imbalance before and after."""
        raise NotImplementedError(f"{self.name} does not rebalance experts")

    def shutdown(self) -> None:
        """Release the device; idempotent."""
