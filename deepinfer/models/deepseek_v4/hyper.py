"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), per token of a flat token list.

The residual is N = hc_mult streams per token, [T, N, H], in the activation dtype. The embedding
is copied into every stream (`expand`). Each block (attention, then MLP) of a layer has its own
`HyperConnection`, which `collapse`s the streams into the block's input [T, H] and computes,
from the streams, how to `update` them with the block's output. After the last layer,
`HyperHead` collapses them into the [T, H] that the final norm and the LM head read.
The numerics follow transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead
(models/deepseek_v4/modeling_deepseek_v4.py, 5.24): gates and Sinkhorn in float32, the update
in the streams' dtype.

Checkpoint names. Our parameters are laid out as transformers' are, so its names map 1:1
once "model." is dropped; DeepSeek's release names are renamed as transformers' conversion
mapping ("deepseek_v4") renames them:

    ours                      transformers                    DeepSeek release        shape
    layers.{i}.attn_hc.fn     model.layers.{i}.attn_hc.fn     layers.{i}.hc_attn_fn    [(2+N)N, NH]
    layers.{i}.attn_hc.base   model.layers.{i}.attn_hc.base   layers.{i}.hc_attn_base  [(2+N)N]
    layers.{i}.attn_hc.scale  model.layers.{i}.attn_hc.scale  layers.{i}.hc_attn_scale [3]
    layers.{i}.ffn_hc.*       model.layers.{i}.ffn_hc.*       layers.{i}.hc_ffn_*      (as attn)
    hc_head.hc_fn             model.hc_head.hc_fn             hc_head_fn               [N, NH]
    hc_head.hc_base           model.hc_head.hc_base           hc_head_base             [N]
    hc_head.hc_scale          model.hc_head.hc_scale          hc_head_scale            [1]

`hyper_target` does this mapping; every one of these parameters stays float32 (`fp32_params`,
transformers' _keep_in_fp32_modules_strict).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from deepinfer.models.ops import ModelOps
from deepinfer.models.traits import Float32Params

# DeepSeek's release names -> transformers' (transformers' conversion_mapping.py, "deepseek_v4")
_RELEASE_NAMES = ((re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
                  (re.compile(r"\.hc_attn_(fn|base|scale)$"), r".attn_hc.\1"),
                  (re.compile(r"\.hc_ffn_(fn|base|scale)$"), r".ffn_hc.\1"))
_OURS = re.compile(r"^(layers\.\d+\.(attn_hc|ffn_hc)\.(fn|base|scale)"
                   r"|hc_head\.hc_(fn|base|scale))$")


def hyper_target(name: str) -> str | None:
    """An mHC checkpoint tensor's name (transformers' or DeepSeek's release) -> our parameter;
    None for every other tensor (the multi-token-prediction layers' `mtp.*` included)."""
    name = name.removeprefix("model.")
    for pattern, renamed in _RELEASE_NAMES:
        name = pattern.sub(renamed, name)
    return name if _OURS.match(name) else None


@dataclass(frozen=True)
class HyperDims:
    hidden_size: int
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float  # the gates' floor and the Sinkhorn denominators' epsilon
    norm_eps: float  # the streams' RMSNorm (config.rms_norm_eps, as transformers uses)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "HyperDims":
        return cls(hidden_size=config.hidden_size, hc_mult=config.hc_mult,
                   sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps,
                   norm_eps=config.rms_norm_eps)

    @property
    def flat(self) -> int:
        return self.hc_mult * self.hidden_size


@dataclass(frozen=True)
class HyperMix:
    """What a collapse computed for its update, per token, float32: post [T, N] (each stream's
    share of the block output) and comb [T, N, N], where comb[t, j, k] is input stream j's
    weight in output stream k (transformers' orientation: it multiplies comb^T @ streams)."""

    post: torch.Tensor
    comb: torch.Tensor


def expand(hidden: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """[T, H] embeddings -> [T, N, H] streams, each a copy (transformers line 1363)."""
    return hidden.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] -> softmax over each row (+eps), then `iters` column normalisations with a
    row normalisation before each but the first (transformers lines 982, 988-991). It ends
    on the columns: they sum to 1 up to eps, the rows only as far as Sinkhorn converged."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse_gates(logits: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor,
                   base: torch.Tensor, iters: int, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of DeepSeekV4Ops.hyper_collapse: gate logits float32 [T, (2+N)N] (pre, post,
    comb) -> (the block's input sum_j pre_j * streams_j [T, H] in the streams' dtype, post
    [T, N], comb [T, N, N]), transformers lines 971-995."""
    n = streams.shape[1]
    pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = sinkhorn(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), iters, eps)
    return weighted_sum(pre, streams), post, comb


def update_streams(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   block_output: torch.Tensor) -> torch.Tensor:
    """The reference of DeepSeekV4Ops.hyper_update: new streams [T, N, H], post[k] * block_output +
    sum_j comb[j, k] * streams[j], the gates rounded to the streams' dtype and the mix run in
    that dtype, as transformers' decoder layer does (lines 1188-1199)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + mixed


def weighted_sum(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre[t, j] * streams[t, j]: float32 products (pre is float32), rounded once to the
    streams' dtype (transformers lines 995, 1015)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class _StreamGates(Float32Params, nn.Module):
    """The part both mHC modules share: gate logits from the RMS-normed, flattened streams."""

    def __init__(self, dims: HyperDims, ops: ModelOps) -> None:
        super().__init__()
        self.dims, self.ops = dims, ops
        # transformers' norm has no weight; ops.rms_norm takes one, so it gets ones (float32,
        # so that the float32 normed streams are multiplied by exactly 1). Not persistent: no
        # checkpoint has it, and init_buffers remakes it after a meta-device build.
        self.register_buffer("unit", torch.ones(dims.flat, dtype=torch.float32),
                             persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        self.unit = torch.ones(self.dims.flat, dtype=torch.float32, device=device)

    def _logits(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """[T, N, H] -> fn @ rms_norm(flatten(streams)), float32 [T, rows of fn] (transformers
        lines 967-970, 1012-1013)."""
        flat = streams.reshape(streams.shape[0], self.dims.flat).float()
        return F.linear(self.ops.rms_norm(flat, self.unit, self.dims.norm_eps), fn)


class HyperConnection(_StreamGates):
    """One block's mHC (a layer's attn_hc or ffn_hc): transformers' DeepseekV4HyperConnection.
    fn [(2+N)N, NH], base [(2+N)N] and scale [3] give the pre (N), post (N) and comb (N*N)
    gates, in that order."""

    fp32_params = ("fn", "base", "scale")

    def __init__(self, dims: HyperDims, ops: ModelOps) -> None:
        super().__init__(dims, ops)
        rows = (2 + dims.hc_mult) * dims.hc_mult
        self.fn = nn.Parameter(torch.empty(rows, dims.flat, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, HyperMix]:
        """streams [T, N, H] -> (the block's input [T, H] in the streams' dtype, the gates
        update() needs); transformers lines 963-996."""
        d = self.dims
        x, post, comb = self.ops.hyper_collapse(self._logits(streams, self.fn), streams,
                                                self.scale, self.base, d.sinkhorn_iters,
                                                d.hc_eps)
        return x, HyperMix(post, comb)

    def update(self, streams: torch.Tensor, mix: HyperMix, block_output: torch.Tensor
               ) -> torch.Tensor:
        """New streams [T, N, H]: post[k] * block_output + sum_j comb[j, k] * streams[j]
        (`update_streams`); block_output [T, H] in the streams' dtype."""
        return self.ops.hyper_update(streams, mix.post, mix.comb, block_output)


class HyperHead(_StreamGates):
    """The final collapse before the model's norm: transformers' DeepseekV4HyperHead. hc_fn
    [N, NH], hc_base [N], hc_scale [1] give a pre gate only."""

    fp32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, dims: HyperDims, ops: ModelOps) -> None:
        super().__init__(dims, ops)
        self.hc_fn = nn.Parameter(torch.empty(dims.hc_mult, dims.flat, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(dims.hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H] -> [T, H] in their dtype (transformers lines 1011-1015)."""
        logits = self._logits(streams, self.hc_fn)
        pre = torch.sigmoid(logits * self.hc_scale + self.hc_base) + self.dims.hc_eps
        return weighted_sum(pre, streams)


def init_hyper_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Remake every mHC module's norm weight on device (after a meta-device build: to_empty
    leaves buffers uninitialised, and .to(dtype) would have cast them)."""
    for module in model.modules():
        if isinstance(module, _StreamGates):
            module.init_buffers(device)
