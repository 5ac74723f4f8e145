"""The torch model runner shared by torch-based backends: load a checkpoint into the model its
architecture names, size and allocate the KV pool from the model's KV spec, run the forward
pass, sample, report memory. A backend brings its ModelOps (kernels) and how it turns a
ModelBatch into the attention metadata its ops read; a plugin author starts here.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.core.accelerator import Capabilities, MemoryStats, ModelInfo, ParallelContext
from deepinfer.core.batch import ModelBatch, SamplerOutput, SamplingRow, TokenLogprobs
from deepinfer.core.config import CacheConfig, ModelSpec
from deepinfer.core.sampler import Sampler, score_tokens
from deepinfer.models import hf_config
from deepinfer.models.moe.runtime import ExpertRuntime
from deepinfer.models.ops import ModelOps
from deepinfer.models.quant.packed import gguf_block_kinds
from deepinfer.models.quant.plan import apply_plan, cast_unpacked, plan_packed
from deepinfer.models.quant.source import checkpoint_source
from deepinfer.models.registry import model_class
from deepinfer.models.traits import Float32Params, ModelTraits, missing_ops
from deepinfer.models.weights import init_dummy_weights

# Scored prompt positions go through the lm_head this many at a time: a long chunk's float32
# logits (rows x vocabulary) would otherwise take gigabytes at once.
PROMPT_LOGPROB_ROWS = 256

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(requested: str, checkpoint: str, supported: tuple[str, ...]) -> torch.dtype:
    """The activation dtype: the requested one, or the checkpoint's for "auto"; refused when
    the backend does not run it (Capabilities.dtypes)."""
    name = checkpoint if requested == "auto" else requested
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    dtype = DTYPES[name]
    if str(dtype).removeprefix("torch.") not in supported:
        if requested == "auto":  # a checkpoint dtype the backend lacks: its widest instead
            return DTYPES["float32" if "float32" in supported else supported[0]]
        raise ValueError(f"this backend runs {', '.join(supported)}, not {name}")
    return dtype


def _restore_float32(model: torch.nn.Module) -> None:
    """Parameters a module keeps in float32 whatever the model's dtype (Float32Params)."""
    for module in model.modules():
        names = module.fp32_params if isinstance(module, Float32Params) else ()
        if names:
            params = dict(module.named_parameters(recurse=False))
            for name in names:
                if name in params:  # an optional parameter may be absent
                    params[name].data = params[name].data.float()


def check_ops(architecture: str, traits: ModelTraits, ops: ModelOps, backend: str) -> None:
    """Refuse a model whose op mixins (ModelTraits.ops) the backend's ops do not inherit."""
    missing = missing_ops(traits, ops)
    if missing:
        raise ValueError(f"{architecture} needs {missing[0].__name__}, which backend "
                         f"{backend!r} does not provide")


def _check_draft_count(traits: ModelTraits, count: int) -> None:
    """A model whose state a verify step can only undo for so many drafts says how many."""
    limit = traits.max_speculative_tokens if count else None
    if limit is not None and count > limit:
        raise ValueError(f"this model verifies at most {limit} speculative tokens a step; "
                         f"num_speculative_tokens is {count}")


class TorchRunner:
    def __init__(self, device: torch.device | str, capabilities: Capabilities,
                 make_ops: Callable[[PagedCache], ModelOps], seed: int = 0,
                 backend: str | None = None) -> None:
        self.device = torch.device(device)
        self.capabilities = capabilities
        # The name load errors give the backend (Accelerator.name); the device type by default.
        self.backend = backend or self.device.type
        self.cache = PagedCache()
        self.ops = make_ops(self.cache)
        self.seed = seed
        self.sampler = Sampler()
        # The family's module: forward, compute_logits, and its draft layer's methods.
        self.model: Any = None
        # Parameter name -> the packed kind it is held in (models/quant/plan.py).
        self.packed: dict[str, str] = {}
        self.info: ModelInfo | None = None
        self.dtype = torch.float32
        # Speculative decoding: the model is built with its MTP draft layer (configure sets it).
        self.num_speculative_tokens = 0

    # ---- model ---------------------------------------------------------------------------
    def load(self, spec: ModelSpec) -> ModelInfo:
        config = hf_config.load_config(spec.path)
        self.dtype = resolve_dtype(spec.dtype, hf_config.checkpoint_dtype(config),
                                   self.capabilities.dtypes)
        max_len = hf_config.max_model_len(config, spec.max_model_len)
        # Built on the meta device: no time goes into random init of weights that are then
        # overwritten.
        arch = hf_config.architecture(config)
        with torch.device("meta"):
            model = model_class(arch)(config, self.ops, max_len, **self._draft_options(arch))
        check_ops(arch, model.traits, self.ops, self.backend)
        _check_draft_count(model.traits, self.num_speculative_tokens)
        source = checkpoint_source(spec.path, config, spec.quantization, self.ops.packed_kinds)
        dummy = spec.load_format == "dummy"
        self.packed = plan_packed(model, {} if dummy else source.kinds(), model.checkpoint_target,
                                  self.ops.packed_kinds, spec.quantization)
        apply_plan(model, self.packed)
        # Cast while still on the meta device: memory is then allocated once, in the model's
        # dtype (a float32 build would need twice a bf16 model's bytes at load).
        cast_unpacked(model, self.dtype)
        _restore_float32(model)
        model = model.to_empty(device=self.device)
        if dummy:
            init_dummy_weights(model, self.seed)
        else:
            model.load_weights(source.tensors(gguf_block_kinds(self.packed.values())))
        model.init_buffers(self.device)
        self.ops.prepare_weights(model)
        self.model = model.eval()
        self.cache.spec = model.kv_spec()
        self.info = ModelInfo(
            vocab_size=config.vocab_size, eos_token_ids=hf_config.eos_token_ids(config, spec.path),
            max_model_len=max_len, kv_spec=self.cache.spec,
            dtype=str(self.dtype).removeprefix("torch."),
            needs_collectives=self.moe is not None and self.moe.exchange is not None)
        return self.info

    def _draft_options(self, arch: str) -> dict[str, Any]:
        """The model's constructor options for speculative decoding: its MTP draft layer."""
        if not self.num_speculative_tokens:
            return {}
        if not model_class(arch).traits.mtp_draft:
            raise ValueError(f"speculative decoding drafts with a DeepSeek-V3 or -V4 "
                             f"checkpoint's multi-token-prediction layer; {arch} has none "
                             f"here (set num_speculative_tokens to 0)")
        parallel = self.ops.parallel
        if parallel is not None and parallel.expert_parallel and parallel.world_size > 1:
            raise ValueError("speculative decoding does not run under expert parallel yet "
                             "(its draft steps would need the ranks' lockstep)")
        return {"mtp": True}

    @property
    def model_info(self) -> ModelInfo:
        if self.info is None:
            raise RuntimeError("no model is loaded")
        return self.info

    # ---- KV pool -------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """Bytes of one page: one block of every KV group."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.cache.kv_spec.block_bytes(block_size, element)

    def pool_blocks(self, cache: CacheConfig) -> int:
        """The KV pool's blocks: --num-kv-blocks, else what the memory budget holds."""
        if cache.num_blocks is not None:
            return cache.num_blocks
        return self.blocks_in(int(cache.kv_cache_memory_gb * (1 << 30)), cache.block_size)

    def blocks_in(self, nbytes: int, block_size: int) -> int:
        return max(2, nbytes // self.block_bytes(block_size))

    def allocate(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self.cache.allocate(num_blocks, block_size, self.dtype, self.device, num_state_slots)

    # ---- steps ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def begin_step(self, num_tokens: int, num_real: int | torch.Tensor) -> None:
        """Before an eager forward of num_tokens, the first num_real of them real (an int, or
        a device scalar that a traced step takes as an input): MoE models agree with the
        other ranks on the step's size (a collective under expert parallel)."""
        if self.moe is not None:
            self.moe.begin_step(num_tokens, num_real)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        return self.sampler.sample(logits, rows)

    def prompt_logprobs(self, hidden: torch.Tensor, batch: ModelBatch
                        ) -> dict[int, list[TokenLogprobs]]:
        """SamplerOutput.prompt_logprobs of a step: the lm_head over the scored rows only,
        `hidden` holding every query token's final hidden state in the batch's order."""
        if not batch.prompt_logprobs:
            return {}
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        out: dict[int, list[TokenLogprobs]] = {}
        for rows in batch.prompt_logprobs:
            first, entries = starts[rows.seq] + rows.first, []
            for lo in range(0, len(rows.token_ids), PROMPT_LOGPROB_ROWS):
                hi = min(lo + PROMPT_LOGPROB_ROWS, len(rows.token_ids))
                logits = self.logits(hidden[first + lo:first + hi])
                entries += score_tokens(logits, rows.token_ids[lo:hi], rows.num_top)
            out[rows.seq] = entries
        return out

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """sample()'s ids left on the device (launch() of an async step)."""
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        return self.sampler.sample_tokens(logits, rows)

    # ---- MoE -----------------------------------------------------------------------------
    @property
    def moe(self) -> ExpertRuntime | None:
        """The model's ExpertRuntime, None for dense models (or before one is loaded)."""
        return None if self.model is None else self.model.moe

    def rebind_group(self, parallel: ParallelContext) -> None:
        """The new group of a regroup, for everything that reads ops.parallel or holds the
        group (the MoE runtime and its exchanges)."""
        self.ops.parallel = parallel
        if self.moe is not None:
            self.moe.rebind(parallel)

    def expert_load(self) -> torch.Tensor | None:
        return None if self.moe is None else self.moe.expert_load()

    def rebalance_experts(self):
        if self.moe is None:
            raise ValueError("this model has no experts to rebalance")
        with torch.inference_mode():
            return self.moe.rebalance()

    # ---- accounting ----------------------------------------------------------------------
    def weights_bytes(self) -> int:
        if self.model is None:
            return 0
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_stats(self, device_total: int, extra: dict[str, int] | None = None) -> MemoryStats:
        return MemoryStats(device_total_bytes=device_total, weights_bytes=self.weights_bytes(),
                           kv_cache_bytes=self.cache.nbytes, extra=extra or {})

    def shutdown(self) -> None:
        self.model = None
        self.cache.free()
