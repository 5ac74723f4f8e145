"""Which layers of a checkpoint are MoE, and their shape, read from each family's config."""
from __future__ import annotations

from transformers import PretrainedConfig

from deepinfer.models.moe.layer import MoEDims
from deepinfer.models.moe.routing import RouterSpec
from deepinfer.models.moe.runtime import ExpertRuntime


def moe_runtime(moe: MoEDims | None, sparse: tuple[bool, ...], ops) -> ExpertRuntime | None:
    """The runtime a model's MoE layers share, placed over the ranks ops.parallel names."""
    if moe is None or not any(sparse):
        return None
    return ExpertRuntime(sum(sparse), moe.router.num_experts, getattr(ops, "parallel", None),
                         moe.router.num_groups)


def llama_family_moe(config: PretrainedConfig) -> tuple[MoEDims | None, tuple[bool, ...]]:
    """Mixtral (every layer sparse, k weights renormalised) and Qwen3-MoE (`norm_topk_prob`,
    dense `mlp_only_layers`, every `decoder_sparse_step`-th layer sparse); (None, all False)
    for dense models."""
    layers = config.num_hidden_layers
    kind = getattr(config, "model_type", "")
    if kind == "mixtral":
        router = RouterSpec(config.num_local_experts, config.num_experts_per_tok)
        return MoEDims(config.hidden_size, config.intermediate_size, router), (True,) * layers
    if kind == "qwen3_moe" and config.num_experts > 0:
        router = RouterSpec(config.num_experts, config.num_experts_per_tok,
                            renormalize=bool(config.norm_topk_prob))
        dense, step = set(config.mlp_only_layers or ()), config.decoder_sparse_step
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        return MoEDims(config.hidden_size, config.moe_intermediate_size, router), sparse
    return None, (False,) * layers


def deepseek_moe(config: PretrainedConfig) -> tuple[MoEDims | None, tuple[bool, ...]]:
    """DeepSeek-V3: sigmoid scores with a correction bias that picks (but does not weigh)
    experts, group-limited top-k, shared experts, routed scaling; layers from
    `first_k_dense_replace` on are sparse."""
    layers = config.num_hidden_layers
    experts = getattr(config, "n_routed_experts", None)
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    if not experts or dense >= layers:
        return None, (False,) * layers
    router = RouterSpec(experts, config.num_experts_per_tok, scoring="sigmoid",
                        renormalize=bool(config.norm_topk_prob), num_groups=config.n_group or 1,
                        topk_groups=config.topk_group or 1,
                        scaling=float(config.routed_scaling_factor))
    shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
    dims = MoEDims(config.hidden_size, config.moe_intermediate_size, router, router_fp32=True,
                   score_bias=True, shared_intermediate=shared)
    return dims, tuple(i >= dense for i in range(layers))
