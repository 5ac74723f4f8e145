"""Router scores -> the top-k experts of each token and their weights: the reference definition
(MoEOps.route calls it; a backend may fuse it).

Three families of routers, one function:
- softmax then top-k (Mixtral; Qwen3-MoE, whose `norm_topk_prob` renormalises the k weights);
- sigmoid with a load-balancing bias that picks the experts but not their weights, optionally
  limited to the best `topk_group` of `n_group` expert groups (DeepSeek-V3), scaled by
  `routed_scaling_factor`;
- sqrt(softplus) scores, otherwise as sigmoid's (DeepSeek-V4, no groups).

DeepSeek-V4's first layers route by hash: a token's k experts are a fixed table row of its id
(`tid2eid [vocab, k]`, from the checkpoint), and the scores only weigh them (`fixed_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # or "sigmoid", "sqrtsoftplus"
    renormalize: bool = True  # divide the k weights by their sum
    num_groups: int = 1  # expert groups (DeepSeek's n_group); 1: no group limit
    topk_groups: int = 1  # groups a token may use (topk_group)
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"unsupported MoE scoring function {self.scoring!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups} "
                             f"groups of which {self.topk_groups} are used")


@dataclass(frozen=True)
class RouteCounts:
    """Where a router adds up the tokens it sends to each expert (EPLB's load and /metrics):
    counts [E] int64 on the device, and num_real, a device scalar: rows of the batch at or past
    it are padding (a CUDA-graph bucket, an idle rank's dummy step) and are not counted."""
    counts: torch.Tensor
    num_real: torch.Tensor

    def add(self, ids: torch.Tensor) -> None:
        """The reference: counts[ids[t, j]] += 1 for every real token t."""
        real = torch.arange(ids.shape[0], device=ids.device) < self.num_real
        self.counts.index_add_(0, ids.reshape(-1), real.repeat_interleave(ids.shape[1]).long())


def select_experts(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
                   fixed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32).
    fixed_ids [T, k] (hash routing): the experts are these, the scores only weigh them (no
    bias, no groups)."""
    logits = logits.float()
    if fixed_ids is not None:
        ids = fixed_ids.long()
        weights = _scores(logits, spec).gather(1, ids)
    elif spec.scoring == "softmax":
        weights, ids = torch.topk(logits.softmax(dim=-1), spec.top_k, dim=-1)
    else:
        weights, ids = _biased_grouped(logits, spec, bias)
    if spec.renormalize:
        # DeepSeek adds 1e-20 to the sum (sigmoid weights may all be ~0); softmax's never are.
        eps = 0.0 if spec.scoring == "softmax" else 1e-20
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return weights, ids.to(torch.int32)


def _scores(logits: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    if spec.scoring == "softmax":
        return logits.softmax(dim=-1)
    if spec.scoring == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()  # sqrtsoftplus (transformers' SqrtSoftplusActivation)


def _biased_grouped(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid or sqrtsoftplus scores: the bias picks the experts, the scores weigh them."""
    scores = _scores(logits, spec)
    choice = scores if bias is None else scores + bias.float()
    if spec.num_groups > 1:
        choice = _mask_groups(choice, spec)
    ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def _mask_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Keep the experts of each token's best topk_groups groups (a group scores the sum of its
    two best experts), -inf elsewhere."""
    tokens, groups = choice.shape[0], spec.num_groups
    grouped = choice.view(tokens, groups, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    keep = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(tokens, -1)
