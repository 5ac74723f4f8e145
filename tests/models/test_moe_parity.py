"""MoE families on the CPU backend against transformers on tiny random-weight checkpoints:
Qwen3-MoE (softmax top-k, norm_topk_prob, a dense mlp_only layer), Mixtral (block_sparse_moe
names, w1/w2/w3), DeepSeek-V3 MoE (sigmoid scores, correction bias, grouped top-k, shared
experts, routed scaling, a dense first layer) on MLA."""
from __future__ import annotations

import pytest
import torch
import transformers

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import ModelSpec
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from deepinfer.models.moe.routing import RouterSpec, select_experts
from deepinfer.testing.conformance import MIN_MARGIN
from tests.checkpoints import checkpoint_cache, make_checkpoint

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3_moe")
# Prompt seeds whose greedy paths keep a top-1/top-2 margin >= MIN_MARGIN.
PROMPT_SEEDS = {"qwen3_moe": 1, "mixtral": 4, "deepseek_v3_moe": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 250, (n,), generator=g).tolist() for n in lengths]


def _reference(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_reference_greedy(model, prompt: list[int], ours: list[int]) -> None:
    """Each of our tokens is the reference's argmax given the prompt and our tokens before it
    (one teacher-forced forward, with a top-1/top-2 margin so float rounding cannot flip it).
    transformers' own generate() is no reference here: with its KV cache, Mixtral's greedy path
    drifts from its full forward's argmax (a token with a 0.3 logit margin flips)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() >= MIN_MARGIN, "near-tie on the reference"
    assert logits.argmax(dim=-1).tolist() == ours


def _prefill_logits(path: str, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    acc = CPUAccelerator()
    acc.init_device()
    acc.load_model(ModelSpec(path, dtype="float32"))
    pages = -(-len(prompt) // block_size)
    table = [pages - i for i in range(pages)]  # out of order
    acc.allocate_kv_cache(pages + 1, block_size)
    n = len(prompt)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    batch = ModelBatch(prompt, list(range(n)), [n], [n], (GroupBatch([table], slots),), [0], [])
    return acc.forward_logits(batch, all_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(checkpoint, family):
    path = checkpoint(family)
    prompt = _prompts((45,))[0]
    ours = _prefill_logits(path, prompt)
    with torch.no_grad():
        ref = _reference(path)(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_chunked_greedy_matches_transformers(checkpoint, family):
    path = checkpoint(family)
    prompts = _prompts((5, 23, 41), seed=PROMPT_SEEDS[family])
    llm = LLM(path, dtype="float32", accelerator="cpu", block_size=16, kv_cache_memory_gb=0.05,
              load_tokenizer=False, max_num_batched_tokens=16)  # chunks the longer prompts
    ref = _reference(path)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(ref, prompt, out.outputs[0].token_ids)


def test_moe_model_reports_its_expert_load(checkpoint):
    llm = LLM(checkpoint("qwen3_moe"), dtype="float32", accelerator="cpu",
              kv_cache_memory_gb=0.05, load_tokenizer=False)
    llm.generate(_prompts((10,)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    load = llm.engine.accelerator.runner.model.moe.expert_load()
    # one sparse layer (layer 0 is dense), 8 experts; 10 prompt tokens + 3 decoded, top-2 each
    assert load.shape == (1, 8) and int(load.sum()) == 13 * 2


def _grouped_reference(logits: torch.Tensor, bias: torch.Tensor, spec: RouterSpec):
    """Per token, by brute force: the best topk_groups groups by the sum of their two best
    biased scores, then the top-k biased experts inside them; weights from unbiased scores."""
    scores = logits.sigmoid()
    ids, weights = [], []
    per_group = spec.num_experts // spec.num_groups
    for row, biased in zip(scores, scores + bias):
        groups = biased.view(spec.num_groups, per_group)
        best = sorted(range(spec.num_groups), key=lambda g: -groups[g].topk(2).values.sum())
        allowed = [e for g in best[:spec.topk_groups] for e in range(g * per_group,
                                                                     (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:spec.top_k]
        w = row[chosen]
        ids.append(sorted(chosen))
        weights.append(dict(zip(chosen, (w / w.sum() * spec.scaling).tolist())))
    return ids, weights


def test_grouped_sigmoid_routing_matches_a_brute_force_reference():
    spec = RouterSpec(16, 3, scoring="sigmoid", num_groups=4, topk_groups=2, scaling=2.5)
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(32, 16, generator=g), torch.randn(16, generator=g) * 0.5
    weights, ids = select_experts(logits, spec, bias)
    ref_ids, ref_weights = _grouped_reference(logits, bias, spec)
    for t in range(32):
        assert sorted(ids[t].tolist()) == ref_ids[t]
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            assert w == pytest.approx(ref_weights[t][e], rel=1e-5)
