"""DeepSeek-V4's MoE as our MoEBlock against transformers' DeepseekV4SparseMoeBlock, on a tiny
random-weight DeepseekV4ForCausalLM: a hash-routed layer (token id -> experts table) and a
learned one (sqrt(softplus) scores, correction bias), both with a swiglu_limit that clamps, a
shared expert and routed scaling. Our blocks run on the CPU ops, loaded through our name mapping
from the module's state_dict (packed experts) and from the checkpoint save_pretrained writes
(DeepSeek's names); the static-shape (Neuron) experts honour the clamp too."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.neuron.moe import StaticMoEOps
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.models.deepseek_v4.moe_names import moe_target, moe_tensors
from deepinfer.models.moe.configs import deepseek_v4_moe, moe_runtime
from deepinfer.models.moe.experts import fused_experts_reference
from deepinfer.models.moe.layer import ClampedSharedExperts, MoEBlock
from deepinfer.models.weights import load_mapped

HIDDEN, VOCAB, LIMIT, TOKENS = 64, 256, 0.4, 24
LAYER_TYPES = ("hash_moe", "moe")


def _config() -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(
        hidden_size=HIDDEN, moe_intermediate_size=32, num_hidden_layers=2, vocab_size=VOCAB,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5,
        mlp_layer_types=list(LAYER_TYPES), swiglu_limit=LIMIT, initializer_range=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the transformers model, the folder its save_pretrained wrote). The table and the bias
    start at zeros in transformers: made random so they count."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(_config()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):  # k distinct experts per token, as a real table has
                gate.tid2eid.copy_(torch.rand(VOCAB, 8, generator=g).topk(2, dim=1).indices)
            else:
                gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
    path = str(tmp_path_factory.mktemp("deepseek_v4"))
    model.save_pretrained(path)
    return model, path


class _Layer(nn.Module):
    def __init__(self, mlp: MoEBlock) -> None:
        super().__init__()
        self.mlp = mlp


class _Model(nn.Module):
    """Just the MoE layers, named as in a model (`layers.{i}.mlp`)."""

    def __init__(self, config: transformers.DeepseekV4Config) -> None:
        super().__init__()
        self.ops = CPUOps(PagedCache())
        dims = deepseek_v4_moe(config)
        self.moe = moe_runtime(dims[0], (True,) * len(dims), self.ops)
        self.layers = nn.ModuleList(_Layer(MoEBlock(d, i, self.ops, self.moe))
                                    for i, d in enumerate(dims))

    def load(self, weights) -> None:
        load_mapped(self, moe_tensors(weights), lambda name: moe_target(self.layers, name))


def _ours_from_state_dict(model) -> _Model:
    ours = _Model(model.config)
    ours.load((n, t) for n, t in model.state_dict().items() if ".mlp." in n)
    return ours


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=g), \
        torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("layer", [0, 1])
def test_moe_block_matches_transformers(reference, layer, implementation):
    model, _ = reference
    ours = _ours_from_state_dict(model)
    hidden, ids = _inputs(layer)
    model.config._experts_implementation = implementation
    with torch.no_grad():
        ref = model.model.layers[layer].mlp(hidden, input_ids=ids).view(-1, HIDDEN)
        out = ours.layers[layer].mlp(hidden.view(-1, HIDDEN), token_ids=ids.view(-1))
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("layer", [0, 1])
def test_router_picks_and_weighs_as_transformers(reference, layer):
    model, _ = reference
    block = _ours_from_state_dict(model).layers[layer].mlp
    hidden, ids = _inputs(10 + layer)
    gate = model.model.layers[layer].mlp.gate
    with torch.no_grad():
        args = (hidden, ids) if LAYER_TYPES[layer] == "hash_moe" else (hidden,)
        _, ref_weights, ref_ids = gate(*args)
        weights, chosen = block._route(hidden.view(-1, HIDDEN), ids.view(-1))
    order, ref_order = chosen.long().sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               ref_weights.gather(1, ref_order.indices), rtol=1e-6, atol=1e-6)
    if LAYER_TYPES[layer] == "hash_moe":  # the experts are the table's, whatever the scores
        assert torch.equal(order.values, gate.tid2eid[ids.view(-1)].sort(dim=1).values)


def test_the_limit_clamps_and_matters(reference):
    """Some gate and up pre-activations pass the limit, and without the clamp (routed and
    shared) the output moves well past the tolerance above."""
    model, _ = reference
    ours = _ours_from_state_dict(model)
    block = ours.layers[1].mlp
    assert isinstance(block.shared_experts, ClampedSharedExperts)
    hidden, ids = _inputs(1)
    x = hidden.view(-1, HIDDEN)
    gate, up = torch.einsum("th,sfh->stf", x, block.w13).chunk(2, dim=-1)
    assert (gate > LIMIT).float().mean() > 0.1 and (up.abs() > LIMIT).float().mean() > 0.1
    with torch.no_grad():
        out = block(x, token_ids=ids.view(-1))
        weights, slots = block._route(x, ids.view(-1))
        tight = fused_experts_reference(x, block.w13, block.w2, weights, slots, LIMIT)
        loose = fused_experts_reference(x, block.w13, block.w2, weights, slots)
        shared = block.shared_experts(x)
        shared_loose = nn.functional.linear(ours.ops.silu_and_mul(
            nn.functional.linear(x, block.shared_experts.gate_up_proj.weight)),
            block.shared_experts.down_proj.weight)
    assert (out - tight - shared).abs().max().item() < 1e-5
    assert (loose - tight).abs().max().item() > 1e-2
    assert (shared_loose - shared).abs().max().item() > 1e-2


def test_checkpoint_names_load_the_same_weights(reference):
    """save_pretrained writes DeepSeek's names (ffn., gate.bias, experts.{e}.w1/w2/w3,
    shared_experts.w1/w2/w3): they load into the same parameters as the state_dict's."""
    model, path = reference
    by_state = dict(_ours_from_state_dict(model).named_parameters())
    ours = _Model(model.config)
    saved = load_file(f"{path}/model.safetensors")
    assert any(".ffn.gate.bias" in n for n in saved) and any("tid2eid" in n for n in saved)
    ours.load((n, t) for n, t in saved.items() if ".ffn." in n)
    for name, param in ours.named_parameters():
        assert torch.equal(param, by_state[name]), name


def test_hash_layer_needs_token_ids_and_counts_routes(reference):
    model, _ = reference
    ours = _ours_from_state_dict(model)
    hidden, ids = _inputs(3)
    x = hidden.view(-1, HIDDEN)
    with pytest.raises(ValueError, match="token_ids"):
        ours.layers[0].mlp(x)
    ours.moe.set_step(TOKENS, TOKENS - 4)  # the last 4 rows are padding: not counted
    for block in (b.mlp for b in ours.layers):
        block(x, token_ids=ids.view(-1))
    load = ours.moe.expert_load()
    assert load.shape == (2, 8) and load.sum(dim=1).tolist() == [(TOKENS - 4) * 2] * 2
    table = ours.layers[0].mlp.tid2eid
    expected = torch.bincount(table[ids.view(-1)[:TOKENS - 4]].reshape(-1), minlength=8)
    assert torch.equal(load[0], expected)


class _StaticOps(StaticMoEOps, CPUOps):
    """The Neuron backend's expert computation over the CPU ops."""


@pytest.mark.parametrize("capacity", [None, 24])
def test_static_experts_honour_the_limit(capacity):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, 16, generator=g)
    w13, w2 = torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 8, generator=g) / 3
    weights = torch.rand(TOKENS, 2, generator=g)
    slots = torch.rand(TOKENS, 4, generator=g).topk(2, dim=1).indices.to(torch.int32)
    slots[::5, 1] = -1  # served elsewhere
    ref = fused_experts_reference(x, w13, w2, weights, slots, swiglu_limit=0.5)
    out = _StaticOps(PagedCache()).fused_experts(x, w13, w2, weights, slots, capacity=capacity,
                                                 swiglu_limit=0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (ref - fused_experts_reference(x, w13, w2, weights, slots)).abs().max() > 1e-2


def test_dummy_weights_give_a_valid_hash_table():
    """load_format="dummy": the integer token -> experts table gets k distinct valid experts per
    row (floating init would fail on it)."""
    import torch

    from deepinfer.backends.cpu.ops import CPUOps
    from deepinfer.backends.torch.paged_cache import PagedCache
    from deepinfer.models.moe.configs import deepseek_v4_moe, moe_runtime
    from deepinfer.models.moe.layer import MoEBlock
    from deepinfer.models.weights import init_dummy_weights

    config = _config()
    dims = deepseek_v4_moe(config)
    ops = CPUOps(PagedCache())
    runtime = moe_runtime(dims[0], (True,) * len(dims), ops)
    block = MoEBlock(next(d for d in dims if d.hash_vocab), 0, ops, runtime)
    init_dummy_weights(block, seed=3)
    table = block.tid2eid
    assert table.dtype == torch.int64 and int(table.min()) >= 0
    assert int(table.max()) < dims[0].router.num_experts
    assert all(len(set(row)) == table.shape[1] for row in table[:50].tolist())
