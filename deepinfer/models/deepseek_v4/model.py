"""DeepSeek-V4 (`DeepseekV4ForCausalLM`) served by the engine: embedding, mHC streams,
decoder layers (block.py), the hyper head, the final norm and the LM head, equal to
transformers' DeepseekV4ForCausalLM.

KV spec. Spec layers 0..L-1 are the model layers' sliding windows (one K=V vector of head_dim
per token, `sliding_window` wide: one windowed KV group); each CSA / HCA layer adds one full
spec layer after them with its compressed entries (compressor.layer_cache_entries: a CSA group
and an HCA group). So the KV groups machinery runs as for any model: the window group frees
the pages out of the window, the compressed groups keep theirs, and page i names tokens
[i * block_size, (i + 1) * block_size) in every group.

State. A sequence's state slot holds every compressed layer's carry-over, layer by layer
(CSA: compressor then indexer), packed by the compressors (`pack_state`), in the model's
dtype; `state_bytes` is their sum. A sequence's first chunk starts from a fresh state.

block_size must be a multiple of 128 (`KVSpec.block_multiple`): at such a page end every
compressor's open window is empty (128 is V4's HCA rate, a multiple of CSA's 4), so the only
live carry-over is CSA's last closed window, which each CSA layer stores per page
(`page_state`, compressor.py): a chunk that starts at a page end, e.g. after a device prefix
hit, resumes from its pages (`KVSpec.state_in_pages`).

Speculative decoding. Built with mtp=True, the model also holds the checkpoint's first MTP
layer (mtp.py) as `mtp`, its window one more spec layer after the compressed ones. forward
returns the residual streams [T, N * H] (the MTP layer reads them); compute_logits runs the
hyper head, the norm and the LM head over the rows it is given. A verify step runs drafts
through the compressors too; `save_carry` / `rewind_carry` undo what rejected drafts did to
the state slots (rewind.py).

Dtypes as transformers loads V4 (_keep_in_fp32_modules_strict): norms, sinks, position biases,
the mHC parameters and the router stay float32 (`fp32_params`, restored by the runner after
its cast); the rope tables are recomputed in float32 by init_buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.core.kv.spec import CacheEntry, KVSpec, LayerKV
from deepinfer.models.deepseek_v4 import names
from deepinfer.models.deepseek_v4.attention import (
    SLIDING,
    RMSNorm,
    UsesOps,
    V4Attention,
    rope_inv_freq,
)
from deepinfer.models.deepseek_v4.block import Placement, V4DecoderLayer
from deepinfer.models.deepseek_v4.cache import V4PagedCache
from deepinfer.models.deepseek_v4.compressor import (
    Compressor,
    layer_cache_entries,
    layer_state_numel,
)
from deepinfer.models.deepseek_v4.hyper import HyperDims, HyperHead, expand, init_hyper_buffers
from deepinfer.models.deepseek_v4.moe_names import moe_tensors
from deepinfer.models.deepseek_v4.mtp import OWN_NAMES, V4MTP
from deepinfer.models.deepseek_v4.ops import DeepSeekV4Ops
from deepinfer.models.deepseek_v4.rewind import DraftRewind
from deepinfer.models.moe.configs import deepseek_v4_moe, moe_runtime
from deepinfer.models.moe.layer import MoEBlock
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.ops import ModelOps
from deepinfer.models.traits import ModelTraits
from deepinfer.models.weight_targets import Target
from deepinfer.models.weights import Embedding, load_mapped

PAGE_MULTIPLE = 128


def _check_supported(config: PretrainedConfig) -> None:
    if getattr(config, "quantization_config", None):
        raise ValueError("quantized DeepSeek-V4 checkpoints (FP8 / FP4 experts) are not "
                         "supported yet; use a bf16 or fp32 checkpoint")
    if getattr(config, "num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek-V4 attention has one shared K=V head; "
                         f"num_key_value_heads={config.num_key_value_heads}")


def placements(config: PretrainedConfig) -> list[Placement]:
    """Each model layer's window spec layer, compressed-entries spec layer (after all the
    window layers) and state offset (elements)."""
    out, extra, offset = [], config.num_hidden_layers, 0
    for i, kind in enumerate(config.layer_types):
        if kind == SLIDING:
            out.append(Placement(i, None, 0))
            continue
        out.append(Placement(i, extra, offset))
        extra += 1
        offset += layer_state_numel(config, kind)
    return out


class DeepseekV4ForCausalLM(nn.Module):
    # Its data path (cache.py) reads every KV group's tables and the state slots from the step
    # metadata; its decode step reads device tensors only (cache.DECODE_FIELDS; the
    # compressors step every sequence at once, decode_compress.py); the compressors' carry-over
    # lives in the state slots.
    traits = ModelTraits(ops=(MoEOps, DeepSeekV4Ops), mtp_draft=True, stateful=True,
                         reads_group_meta=True, graph_decode=True)

    def __init__(self, config: PretrainedConfig, ops: ModelOps, max_model_len: int,
                 mtp: bool = False) -> None:
        super().__init__()
        _check_supported(config)
        self.config, self.ops, self.max_model_len = config, ops, max_model_len
        num_layers = config.num_hidden_layers
        moe = deepseek_v4_moe(config)
        self.moe = moe_runtime(moe[0], (True,) * num_layers, ops)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, i, ops, MoEBlock(moe[i], i, ops, self.moe), place)
            for i, place in enumerate(placements(config)))
        self.hc_head = HyperHead(HyperDims.from_config(config), ops)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.state_numel = sum(layer_state_numel(config, t) for t in config.layer_types)
        windows = num_layers + sum(t != SLIDING for t in config.layer_types)
        self.mtp = V4MTP(config, ops, windows) if mtp else None
        self.rewind = DraftRewind.of(self.layers)
        # rewind_carry undoes what at most this many rejected drafts overwrote.
        self.traits = dataclasses.replace(type(self).traits,
                                          max_speculative_tokens=self.rewind.max_drafts)
        _keep_float32(self)
        for module in self.modules():  # rope and norms through the backend's kernels
            if isinstance(module, UsesOps):
                module.ops = ops

    @property
    def needs_collectives(self) -> bool:
        """MoE layers exchange tokens with the other ranks in every forward."""
        return self.moe is not None and self.moe.exchange is not None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and the compressor state's) dtype."""
        return self.embed_tokens.weight.dtype

    def kv_spec(self) -> KVSpec:
        c = self.config
        window = LayerKV((CacheEntry("kv", (c.head_dim,)),), sliding_window=c.sliding_window)
        compressed = [LayerKV(layer_cache_entries(c, t)) for t in c.layer_types if t != SLIDING]
        draft = [window] if self.mtp is not None else []  # the MTP layer's window, last
        state_bytes = self.state_numel * self.embed_tokens.weight.element_size()
        return KVSpec(tuple([window] * c.num_hidden_layers + compressed + draft), state_bytes,
                      block_multiple=PAGE_MULTIPLE, state_in_pages=True)

    def init_buffers(self, device: torch.device | str) -> None:
        """Rope tables in float32 (a meta-device build leaves them empty, the dtype cast
        would round them), the mHC norms' unit weights, the MoE runtime."""
        for module in self.modules():
            if isinstance(module, V4Attention):
                module.inv_freq = rope_inv_freq(self.config, module.dims.rope_label)[0].to(device)
            elif isinstance(module, Compressor):
                module.rope_inv_freq = rope_inv_freq(self.config, "compress")[0].to(device)
        init_hyper_buffers(self, device)
        for runtime in (self.moe, self.mtp and self.mtp.moe):
            if runtime is not None:
                runtime.to(device)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any
                ) -> torch.Tensor:
        """The residual streams after the last layer, [T, hc_mult * hidden_size]."""
        paged = V4PagedCache(self.ops.cache, meta, self.dtype)
        streams = expand(self.embed_tokens(input_ids), self.config.hc_mult)
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, paged)
        return streams.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """forward's streams of the rows to sample -> float32 logits."""
        return self._head(self.norm(self.hc_head(self._streams(hidden))))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(x, weight).float()

    def _streams(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(flat.shape[0], self.config.hc_mult, self.config.hidden_size)

    # ---- the draft (speculative decoding) ------------------------------------------------
    def draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      previous: torch.Tensor, meta: Any) -> torch.Tensor:
        """The MTP layer at each position: input_ids are the tokens after the positions,
        previous the streams that predicted them (the model's, or the draft's own)."""
        paged = V4PagedCache(self.ops.cache, meta, self.dtype)
        streams = self.mtp(self.embed_tokens(input_ids), input_ids, positions,
                           self._streams(previous), paged)
        return streams.flatten(1)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(self.mtp.head_input(self._streams(hidden)))

    def save_carry(self, state_slots: list[int]) -> torch.Tensor | None:
        """Before a verify step: what rejected drafts may overwrite (rewind.py)."""
        return self.rewind.save(self.ops.cache.state, self.dtype, state_slots)

    def rewind_carry(self, saved: torch.Tensor | None, state_slots: list[int],
                     kept: list[int], verified: list[int]) -> None:
        """After it: sequence i kept positions < kept[i] of the verified < verified[i]; what
        the rejected ones overwrote is put back."""
        self.rewind.rewind(self.ops.cache.state, self.dtype, saved, state_slots, kept, verified)

    # ---- checkpoint ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.mtp is not None:
            weights = self._mtp_renamed(weights)
        try:
            load_mapped(self, moe_tensors(weights), self.checkpoint_target)
        except KeyError as exc:
            if self.mtp is None or "'mtp." not in str(exc):
                raise
            raise ValueError("this checkpoint has no weights for its multi-token-prediction "
                             "layer (mtp.0.*), which speculative decoding drafts with") from None

    def _mtp_renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """`mtp.0.X` -> `layers.{L}.X`, so the block's tensors take the decoder's renames."""
        prefix = f"layers.{self.config.num_hidden_layers}."
        for name, tensor in weights:
            yield (prefix + name[len("mtp.0."):] if name.startswith("mtp.0.") else name), tensor

    def checkpoint_target(self, name: str) -> Target | list[Target] | None:
        prefix = f"layers.{self.config.num_hidden_layers}."
        if self.mtp is not None and name.removeprefix("model.").startswith(prefix):
            return self._mtp_target(name.removeprefix("model.")[len(prefix):])
        return names.checkpoint_target(self.layers, name)

    def _mtp_target(self, rest: str) -> Target | list[Target] | None:
        """A name inside the MTP layer -> our parameter(s) under `mtp.`."""
        if rest in OWN_NAMES:
            return f"mtp.{OWN_NAMES[rest]}", None
        found = names.checkpoint_target(nn.ModuleList([self.mtp.block]), f"layers.0.{rest}")
        if found is None:
            return None
        moved = [(n.replace("layers.0.", "mtp.block.", 1), where)
                 for n, where in ([found] if isinstance(found, tuple) else found)]
        return moved[0] if isinstance(found, tuple) else moved


def _keep_float32(model: nn.Module) -> None:
    """transformers' _keep_in_fp32_modules_strict as the runner's `fp32_params`: the parts
    the attention and compressor modules do not declare themselves."""
    for module in model.modules():
        if isinstance(module, V4Attention):
            module.fp32_params = ("sinks",)
        elif isinstance(module, Compressor):
            module.fp32_params = ("position_bias",)
        elif isinstance(module, RMSNorm):
            module.fp32_params = ("weight",)
