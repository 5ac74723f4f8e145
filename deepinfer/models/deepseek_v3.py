"""DeepSeek V3 (and V2) with Multi-head Latent Attention over backend ops.

Each layer caches one latent per token: [rms-normed c_kv (kv_lora_rank), roped k_pe
(qk_rope_head_dim)], shared by every head. kv_b_proj is split at load time into its key half
W_UK and value half W_UV, which the layer hands to MLAOps.mla_attention with the query's parts.
Decode runs the weight-absorbed form: W_UK folded into the query (q_nope @ W_UK gives a query in
latent space), W_UV applied after attention (its output is a mix of latents), as DeepSeek, vLLM
and SGLang serve it. A backend may expand a long prefill into per-head keys and values instead
(the CUDA backend's kernels/mla_prefill.py), fewer FLOPs per attended pair.

DeepSeek's rope rotates interleaved pairs (x0, x1), (x2, x3), ...; the backends rotate NeoX
halves. The rope rows of the query and k_pe projections are permuted at load time (evens
first, then odds) so that NeoX rotary on our q_pe / k_pe gives exactly the reference's rotated
values.

Layers from `first_k_dense_replace` on are MoE (models/moe): sigmoid router with a score
correction bias, group-limited top-k, shared experts. DeepSeek-V2's MoE routing (softmax,
`topk_method`) is not implemented: V2 checkpoints load when all their layers are dense.

With `mtp=True` (speculative decoding) the model also holds the checkpoint's first
multi-token-prediction layer (models/deepseek_mtp.py) as `mtp`, with one more KV layer.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.core.kv.spec import KVSpec, latent_layer
from deepinfer.models.decoder import DecoderLayer, DecoderStack, GatedMLP
from deepinfer.models.deepseek_mtp import MTP_NAMES, DeepseekMTP
from deepinfer.models.mla_ops import MLAOps
from deepinfer.models.moe.configs import deepseek_moe, moe_runtime
from deepinfer.models.moe.layer import MoEBlock, moe_checkpoint_target
from deepinfer.models.moe.ops import MoEOps
from deepinfer.models.ops import ModelOps
from deepinfer.models.quant.tensors import QUANTIZED_TYPES
from deepinfer.models.rope import rope_parameters
from deepinfer.models.traits import ModelTraits
from deepinfer.models.weight_targets import Target
from deepinfer.models.weights import load_mapped

_FUSED_MLP = {"gate_proj": 0, "up_proj": 1}
_ROPE_ROWS = ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")


@dataclass(frozen=True)
class MLADims:
    """The config fields the model reads (DeepSeek V2 and V3 configs name them alike)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope_interleave: bool

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "MLADims":
        _check_supported(config)
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),  # a V2 field; V3 has none
            # V2 configs have no such field: V2 always rotates interleaved pairs.
            rope_interleave=bool(getattr(config, "rope_interleave", True)))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _check_supported(config: PretrainedConfig) -> None:
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    if getattr(config, "model_type", "") == "deepseek_v2" and dense < config.num_hidden_layers:
        raise ValueError(
            f"DeepSeek-V2 MoE routing is not supported: layers {dense}.."
            f"{config.num_hidden_layers - 1} of this checkpoint are MoE "
            f"(first_k_dense_replace={dense}); DeepSeek-V3 MoE checkpoints are")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; DeepSeek MLPs use silu")


def softmax_scale(config: PretrainedConfig) -> float:
    """transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale^2 for a
    scaled rope with mscale_all_dim (yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and params.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def interleaved_to_halves(rope_dim: int) -> torch.Tensor:
    """Row order that turns interleaved rope pairs (x0, x1), (x2, x3), ... into NeoX halves
    (x0, x2, ... | x1, x3, ...): NeoX rotary on the permuted vector equals the reference's
    apply_rotary_pos_emb_interleave on the original, value for value."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class MLAttention(nn.Module):
    def __init__(self, dims: MLADims, layer: int, ops: ModelOps, scale: float) -> None:
        super().__init__()
        self.dims, self.layer, self.ops, self.scale = dims, layer, ops, scale
        d, bias = dims, dims.attention_bias
        q_out = d.num_heads * d.qk_head_dim
        # The checkpoint's q_proj (or q_a_proj) and kv_a_proj_with_mqa both read the hidden
        # state: one GEMM, rows [query | c_kv | k_pe] (fused_rows), one launch a layer fewer.
        self.q_rows = q_out if d.q_lora_rank is None else d.q_lora_rank
        self.qkv_a_proj = nn.Linear(d.hidden_size, self.q_rows + d.latent_dim, bias=bias)
        if d.q_lora_rank is not None:
            self.q_a_layernorm = nn.Parameter(torch.ones(d.q_lora_rank))
            self.q_b_proj = nn.Linear(d.q_lora_rank, q_out, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(d.kv_lora_rank))
        # kv_b_proj, split and laid out for batched matmuls over heads:
        # w_uk [H, qk_nope, L] takes q_nope into latent space; w_uv [H, L, v_head] (W_UV
        # transposed) takes an attention output in latent space to the head's value.
        self.w_uk = nn.Parameter(torch.empty(d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(d.num_heads, d.kv_lora_rank, d.v_head_dim))
        self.o_proj = nn.Linear(d.num_heads * d.v_head_dim, d.hidden_size, bias=bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: Any) -> torch.Tensor:
        d, ops = self.dims, self.ops
        tokens = hidden.shape[0]
        qkv_a = ops.linear(hidden, self.qkv_a_proj.weight, self.qkv_a_proj.bias)
        q = self._query(qkv_a[:, :self.q_rows]).view(tokens, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv = qkv_a[:, self.q_rows:]
        # One shared rope key: a single "kv head". A backend may rotate in place.
        q_pe, k_pe = ops.rotary(q_pe, kv[:, d.kv_lora_rank:].unsqueeze(1), positions, cos, sin)
        latent = ops.mla_latent(kv, k_pe.squeeze(1), self.kv_a_layernorm, d.rms_norm_eps)
        values = ops.mla_attention(q_nope, q_pe, latent, self.w_uk, self.w_uv, self.layer, meta,
                                   self.scale)
        return ops.linear(values.reshape(tokens, d.num_heads * d.v_head_dim),
                          self.o_proj.weight, self.o_proj.bias)

    def _query(self, q_a: torch.Tensor) -> torch.Tensor:
        """The heads' queries from qkv_a_proj's query rows: those rows themselves (q_proj), or
        q_b_proj of their norm (q_lora_rank)."""
        if self.dims.q_lora_rank is None:
            return q_a
        q_a = self.ops.rms_norm(q_a, self.q_a_layernorm, self.dims.rms_norm_eps)
        return self.ops.linear(q_a, self.q_b_proj.weight)

    def fused_rows(self, proj: str) -> tuple[int, int]:
        """The rows of qkv_a_proj that the checkpoint's q_proj / q_a_proj or
        kv_a_proj_with_mqa fill."""
        if proj == "kv_a_proj_with_mqa":
            return self.q_rows, self.q_rows + self.dims.latent_dim
        return 0, self.q_rows


class DeepseekV3ForCausalLM(DecoderStack):
    traits = ModelTraits(ops=(MLAOps, MoEOps), mtp_draft=True)

    def __init__(self, config: PretrainedConfig, ops: ModelOps, max_model_len: int,
                 mtp: bool = False) -> None:
        self.dims = d = MLADims.from_config(config)
        scale = softmax_scale(config)
        moe, sparse = deepseek_moe(config)
        runtime = moe_runtime(moe, sparse, ops)
        mlps = [MoEBlock(moe, sum(sparse[:i]), ops, runtime) if sparse[i]
                else GatedMLP(d.hidden_size, d.intermediate_size, ops, d.mlp_bias)
                for i in range(d.num_layers)]
        layers = [DecoderLayer(MLAttention(d, i, ops, scale), mlps[i], d.hidden_size,
                               d.rms_norm_eps, ops) for i in range(d.num_layers)]
        super().__init__(config, ops, max_model_len, d.vocab_size, d.hidden_size, d.rms_norm_eps,
                         d.tie_word_embeddings, layers)
        self.moe = runtime
        self.traits = self._moe_traits(runtime, MLAOps)  # dense V3 checkpoints need no MoEOps
        self.mtp = _build_mtp(config, d, ops, scale) if mtp else None

    def kv_spec(self) -> KVSpec:
        layers = self.dims.num_layers + (self.mtp is not None)  # the MTP layer's KV last
        return KVSpec.uniform(layers, latent_layer(self.dims.latent_dim))

    def init_buffers(self, device: torch.device | str) -> None:
        self.init_rope(self.dims.qk_rope_head_dim, device)
        for runtime in (self.moe, self.mtp and self.mtp.moe):
            if runtime is not None:
                runtime.to(device)

    # ---- the draft (speculative decoding) ------------------------------------------------
    def draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      previous: torch.Tensor, meta: Any) -> torch.Tensor:
        """The MTP layer at each position: input_ids are the tokens after the positions,
        previous the hidden states that predicted them (the model's, or the draft's own)."""
        return self.mtp(input_ids, positions, previous, self.rope_cos, self.rope_sin, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.compute_logits(hidden)

    # ---- checkpoint names ----------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            load_mapped(self, self._absorbed(weights), self.checkpoint_target)
        except KeyError as exc:
            if self.mtp is None or "'mtp." not in str(exc):
                raise
            raise ValueError(f"this checkpoint has no weights for its multi-token-prediction "
                             f"layer (model.layers.{self.dims.num_layers}.*), which "
                             f"speculative decoding drafts with") from None

    def _absorbed(self, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint as this model stores it: rope rows in NeoX order, kv_b_proj split
        into w_uk / w_uv (named `...self_attn.w_uk` / `.w_uv`), and zeros for q_proj's part of
        a fused bias (q_proj has none where kv_a_proj_with_mqa has one)."""
        d = self.dims
        for name, tensor in weights:
            match = re.match(r"(.*self_attn\.)(\w+)\.(weight|bias)$", name)
            proj = match.group(2) if match else None
            if isinstance(tensor, QUANTIZED_TYPES) and (proj == "kv_b_proj" or (
                    proj in _ROPE_ROWS and d.rope_interleave)):
                tensor = tensor.dequantize()  # split or reordered here: as floats
            if proj == "kv_b_proj":
                w = tensor.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
                w_uk, w_uv = w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
                yield match.group(1) + "w_uk", w_uk.contiguous()
                yield match.group(1) + "w_uv", w_uv.transpose(1, 2).contiguous()
            elif proj in _ROPE_ROWS and d.rope_interleave:
                yield name, self._rope_rows_to_halves(proj, tensor)
            else:
                yield name, tensor
            if proj == "kv_a_proj_with_mqa" and name.endswith(".bias") and d.q_lora_rank is None:
                # q_proj has no bias: its rows of the fused qkv_a_proj bias are zeros
                yield match.group(1) + "q_proj.bias", tensor.new_zeros(d.num_heads * d.qk_head_dim)

    def _rope_rows_to_halves(self, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        d = self.dims
        perm = interleaved_to_halves(d.qk_rope_head_dim)
        out = tensor.clone()
        if proj == "kv_a_proj_with_mqa":  # rows [c_kv | k_pe]
            out[d.kv_lora_rank:] = tensor[d.kv_lora_rank:][perm]
            return out
        heads = out.view(d.num_heads, d.qk_head_dim, *tensor.shape[1:])  # per head [nope | pe]
        heads[:, d.qk_nope_head_dim:] = heads[:, d.qk_nope_head_dim:][:, perm].clone()
        return out

    def checkpoint_target(self, name: str) -> Target | list[Target] | None:
        """Checkpoint name (after _absorbed) -> (our parameter, rows of a fused one); None to
        skip."""
        name = name.removeprefix("model.")
        if name.startswith("lm_head."):
            return None if self.lm_head is None else (name, None)
        if name == "norm.weight":
            return "norm", None
        if "rotary_emb" in name:
            return None
        match = re.match(r"layers\.(\d+)\.(.+)$", name)
        if match is None:
            return name, None
        layer, rest = int(match.group(1)), match.group(2)
        if layer == self.dims.num_layers and self.mtp is not None:
            return self._mtp_target(rest)
        if layer >= self.dims.num_layers:
            return None  # multi-token-prediction layers past the decoder (V3's layer 61)
        moe = moe_checkpoint_target(self.layers, name)
        if moe is not None:
            return moe
        return _layer_target(self.layers[layer], f"layers.{layer}", rest)

    def _mtp_target(self, rest: str) -> Target | list[Target]:
        """A name inside the first MTP layer (after `layers.{num_layers}.`) -> our parameter."""
        if rest in MTP_NAMES:
            return f"mtp.{MTP_NAMES[rest]}", None
        moe = moe_checkpoint_target([self.mtp.block], f"layers.0.{rest}")
        if moe is not None:
            return [(name.replace("layers.0.", "mtp.block.", 1), where) for name, where in moe]
        return _layer_target(self.mtp.block, "mtp.block", rest)


def _build_mtp(config: PretrainedConfig, d: MLADims, ops: ModelOps,
               scale: float) -> DeepseekMTP:
    """The first MTP layer: decoder layer `num_layers` of the same stack (MoE when the stack's
    rule makes that layer sparse), with its own expert runtime."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError("this checkpoint has no multi-token-prediction layer "
                         "(num_nextn_predict_layers is 0); speculative decoding needs one")
    grown = copy.copy(config)
    grown.num_hidden_layers = d.num_layers + 1
    moe, sparse = deepseek_moe(grown)
    runtime = moe_runtime(moe, (True,), ops) if sparse[-1] else None
    mlp = MoEBlock(moe, 0, ops, runtime) if runtime is not None \
        else GatedMLP(d.hidden_size, d.intermediate_size, ops, d.mlp_bias)
    block = DecoderLayer(MLAttention(d, d.num_layers, ops, scale), mlp, d.hidden_size,
                         d.rms_norm_eps, ops)
    return DeepseekMTP(block, d.vocab_size, d.hidden_size, d.rms_norm_eps, ops, runtime)


def _layer_target(layer: DecoderLayer, prefix: str, rest: str) -> Target:
    """A name inside one decoder layer -> our parameter."""
    norm = re.match(r"(input_layernorm|post_attention_layernorm|self_attn\.q_a_layernorm"
                    r"|self_attn\.kv_a_layernorm)\.weight$", rest)
    if norm:
        return f"{prefix}.{norm.group(1)}", None
    attn = re.match(r"self_attn\.(q_proj|q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$", rest)
    if attn:
        rows = layer.self_attn.fused_rows(attn.group(1))
        return f"{prefix}.self_attn.qkv_a_proj.{attn.group(2)}", rows
    fused = re.match(r"mlp\.(gate_proj|up_proj)\.(weight|bias)$", rest)
    if fused:
        rows = layer.mlp.fused_rows(_FUSED_MLP[fused.group(1)])
        return f"{prefix}.mlp.gate_up_proj.{fused.group(2)}", rows
    return f"{prefix}.{rest}", None
