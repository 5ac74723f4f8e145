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
    parallel = None if ops is None else ops.parallel  # None: built for its KV spec alone
    return ExpertRuntime(sum(sparse), moe.router.num_experts, parallel,
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


def deepseek_v4_moe(config: PretrainedConfig) -> tuple[MoEDims, ...]:
    """DeepSeek-V4, one MoEDims per layer (every layer is MoE): sqrt(softplus) scores (or
    sigmoid, `scoring_func`), no expert groups, the k weights always renormalised (as
    transformers does, whatever `norm_topk_prob` says) times `routed_scaling_factor`; one shared
    expert of `moe_intermediate_size` (transformers builds exactly one); `swiglu_limit` clamps
    routed and shared experts. "moe" layers pick by score plus a correction bias; "hash_moe"
    layers (`mlp_layer_types`) take a token-id table's experts and have no bias."""
    scoring = config.scoring_func
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"unsupported DeepSeek-V4 scoring_func {scoring!r}")
    router = RouterSpec(config.n_routed_experts, config.num_experts_per_tok, scoring=scoring,
                        renormalize=True, scaling=float(config.routed_scaling_factor))
    limit = None if config.swiglu_limit is None else float(config.swiglu_limit)
    # Router in float32 as for V3 (transformers' V4 router runs in the model's dtype: the same
    # in float32; in bf16 ours rounds less).
    common = dict(hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                  router=router, router_fp32=True,
                  shared_intermediate=config.moe_intermediate_size, swiglu_limit=limit)
    hashed = MoEDims(**common, hash_vocab=config.vocab_size)
    learned = MoEDims(**common, score_bias=True)
    return tuple(hashed if kind == "hash_moe" else learned for kind in config.mlp_layer_types)
