"""ModelOps of the Neuron backend: the reference torch ops for norms, rotary and activations
(they are static already), static paged attention (MLA's latent attention on the same static
kernel: one shared latent head, keys all of it, values its first dims), and the static MoE
(moe.py), and DeepSeek-V4's ops (the norm, rope and mHC references are static; its attention
runs in static shapes, models/deepseek_v4/static.py, on the step metadata this backend
builds)."""
from __future__ import annotations

import torch

from deepinfer.backends.neuron.attention import StaticMeta, static_paged_attention
from deepinfer.backends.neuron.moe import StaticMoEOps
from deepinfer.backends.neuron.timing import RegionTimer
from deepinfer.backends.torch.ops import ReferenceOps
from deepinfer.models.deepseek_v4.ops import DeepSeekV4Ops
from deepinfer.models.mla_ops import MLAOps


class NeuronOps(StaticMoEOps, MLAOps, DeepSeekV4Ops, ReferenceOps):
    def __init__(self, cache, timer: RegionTimer | None = None) -> None:
        super().__init__(cache)
        self.timer = timer or RegionTimer(enabled=False)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  meta: StaticMeta) -> torch.Tensor:
        group = meta.group_of[layer]
        k_cache, v_cache = self.cache.layer(layer)
        with self.timer.region("attention"):
            slots = meta.slot_mapping[group]
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
            return static_paged_attention(q, k_cache, v_cache, meta.tables[group],
                                          meta.positions, meta.block_size,
                                          meta.windows[group])

    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, layer: int,
                         meta: StaticMeta, value_dim: int, scale: float) -> torch.Tensor:
        group = meta.group_of[layer]
        (cache,) = self.cache.layer(layer)
        with self.timer.region("attention"):
            cache.index_copy_(0, meta.slot_mapping[group], latent.to(cache.dtype))
            keys = cache.unsqueeze(1)  # [slots, 1, L]: one latent head shared by every head
            return static_paged_attention(q, keys, keys[..., :value_dim], meta.tables[group],
                                          meta.positions, meta.block_size,
                                          meta.windows[group], scale)

    def expert_exchange(self, group, rank: int, world_size: int, slots_per_rank: int):
        exchange = super().expert_exchange(group, rank, world_size, slots_per_rank)
        exchange.timer = self.timer
        return exchange
