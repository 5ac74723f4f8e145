"""Frozen configuration dataclasses; the one place that reads DEEPINFER_* environment variables.

Every engine setting is a dataclass field whose metadata carries its help text, so the
`deepinfer-serve` flags, the `LLM(...)` keywords and their help all come from here:
`engine_options()` walks the fields and `engine_config_from_options()` builds an EngineConfig
from them. Field metadata keys:

- "help": what the setting means (required for every exposed field);
- "flag": the CLI flag where it is not `--field-name` (a bool that defaults to True is turned
  off by a `--no-...` flag);
- "choices": the values the CLI accepts;
- "internal": set by the engine itself, neither a flag nor an LLM keyword.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

ENV_ACCELERATOR = "DEEPINFER_ACCELERATOR"
ENV_CACHE_DIR = "DEEPINFER_CACHE_DIR"
ENV_CPU_THREADS = "DEEPINFER_CPU_THREADS"

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATION_MODES = ("auto", "none", "fp8")


@dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to run and how: an HF folder (config.json + safetensors + tokenizer)."""

    # Given as LLM(model) / --model, which first resolve a .gguf file or the default model.
    path: str = field(metadata={"internal": True,
                                "help": "HF folder: config.json + safetensors + tokenizer"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations; auto: the checkpoint's torch_dtype (float32 if none)",
        "choices": DTYPE_CHOICES})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length (default: the checkpoint's max_position_embeddings)"})
    load_format: str = field(default="auto", metadata={
        "help": "auto: the checkpoint's safetensors; dummy: random weights made on the device "
                "(benchmarks of a model shape without its checkpoint)",
        "choices": LOAD_FORMATS})

    quantization: str = field(default="auto", metadata={
        "help": "auto: keep the checkpoint's quantized weights (GGUF blocks, FP8 with block "
                "scales) where the backend runs them, dequantize the rest; none: dequantize "
                "all; fp8: also quantize float linear weights to FP8 at load (nvidia)",
        "choices": QUANTIZATION_MODES})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "run Python that the model folder ships (its encoding.py chat encoder, a "
                "tokenizer class its auto_map names); off, a checkpoint's code is never "
                "imported"})

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, "
                             f"got {self.quantization!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=128, metadata={
        "help": "tokens per KV block (one prefix-cache page)"})
    num_blocks: int | None = field(default=None, metadata={
        "flag": "--num-kv-blocks",
        "help": "KV blocks per rank, the null block 0 included (default: sized from the "
                "memory settings)"})
    kv_cache_memory_gb: float = field(default=1.0, metadata={
        "help": "KV pool of host-memory backends (cpu)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "flag": "--no-prefix-caching",
        "help": "the prefix cache, on the device and in the HiCache host tier (requests "
                "reuse the KV pages of prompt prefixes computed before)"})
    hicache_size_gb: float = field(default=0.0, metadata={
        "help": "host memory per rank for HiCache, a host tier of KV pages behind the device "
                "prefix cache (0: off)"})
    hicache_shared: bool = field(default=True, metadata={
        "flag": "--no-hicache-shared",
        "help": "with several ranks on a node (--dp), one HiCache host pool in shared memory "
                "for all of them (hicache_size_gb each, pooled): any rank hits a page any rank "
                "stored, and a restarted rank keeps the node's pages (off: a pool per rank)"})
    hicache_disk_dir: str | None = field(default=None, metadata={
        "help": "a local folder for HiCache's disk tier: host pages are written back there "
                "(checksummed; kept across restarts, shared by the ranks of a node) and read "
                "back when a prompt's pages match (default: no disk tier)"})
    hicache_disk_gb: float = field(default=64.0, metadata={
        "help": "disk space per rank for the disk tier (least recently used pages are "
                "deleted beyond it)"})
    hicache_disk_write_mb_s: float = field(default=0.0, metadata={
        "help": "a cap on each rank's write-back bandwidth to the disk tier in MB/s, so "
                "write-back leaves the disk to reads and to other users (0: none)"})
    hicache_state_slots: int = field(default=0, metadata={
        "help": "host slots for per-request layer state (models that keep state besides KV "
                "pages only)"})
    yoco_keep_tokens: int = field(default=140, metadata={
        "help": "a host-tier hit leaves at least this many prompt tokens to recompute"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "GPU backends: fraction of device memory for weights, activations and the KV "
                "pool, which gets what a profiling step at the full token budget leaves"})

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.hicache_size_gb < 0 or self.hicache_state_slots < 0 or self.yoco_keep_tokens < 0:
            raise ValueError("hicache_size_gb, hicache_state_slots and yoco_keep_tokens "
                             "must be >= 0")
        if self.hicache_disk_dir is not None and self.hicache_size_gb <= 0:
            raise ValueError("hicache_disk_dir needs the host tier (hicache_size_gb > 0): disk "
                             "pages are read into host pages")
        if self.hicache_disk_write_mb_s < 0:
            raise ValueError("hicache_disk_write_mb_s must be >= 0")
        if self.hicache_disk_gb <= 0:
            raise ValueError(f"hicache_disk_gb must be > 0, got {self.hicache_disk_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")


def _limit(value: int | None, name: str) -> int:
    if value is None:
        raise ValueError(f"{name} is read before the backend's default was applied")
    return value


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens in one step (prefill chunks + decodes): the per-step token budget "
                "(default: the backend's, 2048 on cpu and neuron, 8192 on nvidia)"})
    max_num_seqs: int | None = field(default=None, metadata={
        "help": "sequences in one step's batch (default: the backend's, 64 on cpu and "
                "neuron, 256 on nvidia)"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "flag": "--no-chunked-prefill",
        "help": "chunked prefill: a prompt is prefilled over several steps within the token "
                "budget (off: a prompt longer than max_num_batched_tokens is never scheduled "
                "and stalls the queue behind it)"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "a prefill longer than this is cut into chunks even when the budget has room, "
                "so that decodes of other requests keep flowing (0: no cap beyond the "
                "budget)"})
    prefill_beside_decodes: int | None = field(default=None, metadata={
        "help": "most prefill tokens in a step that also decodes running requests, so that "
                "a long prompt does not hold their next tokens for a whole large chunk "
                "(default: the backend's choice, 256 on cpu, no cap elsewhere; 0: no cap)"})
    num_speculative_tokens: int = field(default=0, metadata={
        "help": "speculative decoding: tokens the model's multi-token-prediction (MTP) layer "
                "drafts per step and sequence, all verified by one forward of the model "
                "(DeepSeek-V3 and -V4 checkpoints with MTP weights; 0: off)"})
    async_scheduling: bool = field(default=True, metadata={
        "flag": "--no-async-scheduling",
        "help": "async scheduling: schedule and launch the next step while this one runs on "
                "the device (its new tokens are read one step later), on backends that "
                "support it; steps with logprobs, penalties, grammars or speculative "
                "decoding still run one at a time"})

    @property
    def step_tokens(self) -> int:
        """max_num_batched_tokens, once set (Engine sets what the config leaves unset to the
        backend's Capabilities before anything reads it)."""
        return _limit(self.max_num_batched_tokens, "max_num_batched_tokens")

    @property
    def step_seqs(self) -> int:
        """max_num_seqs, once set (as step_tokens)."""
        return _limit(self.max_num_seqs, "max_num_seqs")

    def __post_init__(self) -> None:
        if any(limit is not None and limit < 1
               for limit in (self.max_num_batched_tokens, self.max_num_seqs)):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.prefill_beside_decodes is not None and self.prefill_beside_decodes < 0:
            raise ValueError("prefill_beside_decodes must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks share the work: data parallel ranks (one process and device each) on one or
    several hosts, expert parallelism across them (MoE layers), expert load balancing (EPLB),
    tensor parallel size (1 only, for now)."""

    dp: int = field(default=1, metadata={
        "help": "engine processes on this host (one per device); LLM(...) runs one engine, so "
                "dp=1 there"})
    ep: bool = field(default=False, metadata={
        "help": "expert parallel: the ranks of every host form one torch.distributed group "
                "(gloo on CPU, NCCL on CUDA) and step in lockstep (an idle rank runs a dummy "
                "step); each rank holds its share of every MoE layer's experts and the layers "
                "exchange tokens. On by default for MoE models when there are several ranks; "
                "with a dense model the ranks just step together"})
    auto_ep: bool = field(default=True, metadata={
        "flag": "--no-ep",
        "help": "expert parallel by default for MoE models with several ranks (off: every "
                "rank holds every expert, as independent replicas)"})
    tp: int = field(default=1, metadata={
        "help": "tensor parallel size (only 1 is supported yet)"})
    nnodes: int = field(default=1, metadata={
        "help": "hosts the rank group spans, each running its own deepinfer-serve with the "
                "same --dp (default: from torchrun's environment, else 1)"})
    node_rank: int = field(default=0, metadata={
        "help": "this host's index among --nnodes: its ranks are node_rank * dp .. + dp - 1 "
                "(default: from torchrun's environment, else 0)"})
    # Where ranks meet for torch.distributed: on one host the API process picks a free port
    # when 0; across hosts every host names node 0's address and one agreed port.
    master_addr: str = field(default="127.0.0.1", metadata={
        "help": "host of the torch.distributed rendezvous (node 0; default: MASTER_ADDR under "
                "torchrun)"})
    master_port: int = field(default=0, metadata={
        "help": "port of the torch.distributed rendezvous (0: a free one, one host only; "
                "default under torchrun: MASTER_PORT + 1, as torchrun's own store holds "
                "MASTER_PORT)"})
    eplb_interval: float = field(default=0.0, metadata={
        "help": "EPLB: seconds between expert rebalances under expert parallel (0: never on a "
                "timer); each rebalance places experts (and replicas of the hot ones) from the "
                "load since the last one and moves their weights between ranks"})
    eplb_after_prefill: bool = field(default=False, metadata={
        "help": "EPLB: rebalance after every step that prefilled prompt tokens"})
    eplb_redundant_experts: int = field(default=0, metadata={
        "help": "EPLB: expert slots beyond one per expert, over all ranks, for replicas of the "
                "busiest experts ((experts + this) must divide by the rank count)"})

    def __post_init__(self) -> None:
        if self.dp < 1 or self.nnodes < 1:
            raise ValueError(f"dp and nnodes must be >= 1, got {self.dp} and {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several hosts need --master-addr and --master-port (node 0's)")
        if self.tp != 1:
            raise ValueError("tensor parallelism is not supported yet; use tp=1")
        if self.eplb_interval < 0 or self.eplb_redundant_experts < 0:
            raise ValueError("eplb_interval and eplb_redundant_experts must be >= 0")

    @property
    def world_size(self) -> int:
        """Ranks over every host."""
        return self.dp * self.nnodes * self.tp

    @property
    def first_rank(self) -> int:
        """The global rank of this host's first rank."""
        return self.node_rank * self.dp

    @property
    def eplb(self) -> bool:
        return self.eplb_interval > 0 or self.eplb_after_prefill


def torchrun_parallel(options: dict[str, Any], environ: typing.Mapping[str, str]) -> dict:
    """Multi-host settings from the environment torchrun gives each host's process (one per
    host: `torchrun --nnodes N --nproc-per-node 1 ...`), for those the options leave unset."""
    if "WORLD_SIZE" not in environ or "GROUP_RANK" not in environ:
        return options
    per_host = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    derived = {"nnodes": int(environ["WORLD_SIZE"]) // per_host,
               "node_rank": int(environ["GROUP_RANK"]),
               "master_addr": environ.get("MASTER_ADDR", "127.0.0.1"),
               "master_port": int(environ.get("MASTER_PORT", "29499")) + 1}
    defaults = ParallelConfig()
    unset = {k: v for k, v in derived.items() if options.get(k, getattr(defaults, k))
             == getattr(defaults, k)}
    return {**options, **unset}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    accelerator: str | None = field(default=None, metadata={
        "help": "a backend name or alias (see --list-accelerators; else DEEPINFER_ACCELERATOR, "
                "else the first available by priority)"})
    seed: int = field(default=0, metadata={
        "help": "seed of the per-request seeds of unseeded requests"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "GPU backends: no CUDA graphs (every step runs eagerly: debugging, "
                "profiling)"})


# The value types a setting may have: each maps to one kind of CLI flag.
OPTION_TYPES = (int, float, str, bool)


@dataclass(frozen=True)
class EngineOption:
    """One engine setting, as a `deepinfer-serve` flag and an `LLM(...)` keyword."""

    section: str | None  # the EngineConfig field holding it (model, cache, ...); None: its own
    name: str  # the dataclass field name, which is also the LLM keyword
    type: type  # one of OPTION_TYPES, `| None` removed
    optional: bool  # None is a value (`X | None`)
    default: Any
    help: str
    flag: str
    choices: tuple[str, ...] | None

    @property
    def negated(self) -> bool:
        """A bool that is on by default: its flag turns it off."""
        return self.type is bool and self.default is True

    @property
    def dest(self) -> str:
        """argparse's attribute for the flag (the flag's name, as argparse derives it)."""
        return self.flag.removeprefix("--").replace("-", "_")


def config_sections() -> dict[str, type]:
    """EngineConfig's fields that are config dataclasses: section name -> class."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)
            if dataclasses.is_dataclass(hints[f.name])}


def engine_options() -> tuple[EngineOption, ...]:
    """Every exposed engine setting, in field order: the sections' fields, then
    EngineConfig's own. Computed from the dataclasses on each call (it is cheap)."""
    options = [option for section, cls in config_sections().items()
               for option in _class_options(cls, section)]
    return tuple(options + _class_options(EngineConfig, None))


def _class_options(cls: type, section: str | None) -> list[EngineOption]:
    hints = typing.get_type_hints(cls)
    return [_option(f, hints[f.name], section) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(hints[f.name]) and not f.metadata.get("internal")]


def _option(f: dataclasses.Field, hint: Any, section: str | None) -> EngineOption:
    where = f"{section or 'EngineConfig'}.{f.name}"
    base, optional = _unwrap_optional(hint)
    if base not in OPTION_TYPES or (base is bool and optional):
        raise TypeError(f"{where}: {hint} has no flag form; use int, float, str, bool or X | None")
    if not f.metadata.get("help"):
        raise TypeError(f"{where} has no metadata['help'] (its flag and LLM docs need one)")
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{where} needs a default to be an option")
    choices = f.metadata.get("choices")
    return EngineOption(section, f.name, base, optional, f.default, f.metadata["help"],
                        f.metadata.get("flag") or _default_flag(f.name, base, f.default),
                        tuple(choices) if choices else None)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def _default_flag(name: str, base: type, default: Any) -> str:
    if base is bool and default is True:  # enable_foo -> --no-foo
        return "--no-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


def check_option_names(options: typing.Iterable[str], extra: tuple[str, ...] = ()) -> None:
    """TypeError naming the unknown ones (`extra`: other keywords the caller accepts)."""
    valid = {option.name for option in engine_options()} | set(extra)
    unknown = [name for name in options if name not in valid]
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; valid "
                        f"options: {', '.join(sorted(valid))}")


def engine_config_from_options(model_path: str, **options: Any) -> EngineConfig:
    """An EngineConfig from settings given by field name (LLM's keywords, the parsed CLI
    flags); settings left out keep their dataclass defaults."""
    check_option_names(options)
    sections = config_sections()
    values: dict[str | None, dict[str, Any]] = {name: {} for name in [*sections, None]}
    values["model"]["path"] = model_path  # ModelSpec's one field without a default
    for option in engine_options():
        if option.name in options:
            values[option.section][option.name] = options[option.name]
    parts = {name: cls(**values[name]) for name, cls in sections.items()}
    return EngineConfig(**parts, **values[None])


def accelerator_from_env() -> str | None:
    value = os.environ.get(ENV_ACCELERATOR, "").strip().lower()
    return value or None


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return os.environ.get(ENV_CACHE_DIR, default)


def cpu_threads() -> int | None:
    value = os.environ.get(ENV_CPU_THREADS)
    return int(value) if value else None
