"""DeepSeek V3 / V2 (MLA, weight-absorbed, dense layers) on the CPU backend against transformers'
own DeepSeek models on tiny random-weight checkpoints: prefill logits, greedy decoding through
the engine (batched, chunked, after a prefix hit, through HiCache's host tier), the KV spec."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import transformers

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import ModelSpec
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.testing.conformance import MIN_MARGIN
from deepinfer.testing.hicache import check_host_tier
from tests.checkpoints import checkpoint_cache

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
VOCAB = 256
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=512,
            initializer_range=0.1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, eos_token_id=255, bos_token_id=1,
            tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}
# name -> (transformers family, config overrides, weight seed). Seeds are picked so that the
# reference greedy paths below keep a top-1/top-2 logit margin >= MIN_MARGIN.
VARIANTS = {
    "v3": ("v3", dict(num_hidden_layers=3), 10),
    "v3_q_proj": ("v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True), 0),
    "v3_yarn": ("v3", dict(rope_parameters=YARN), 3),
    "v2": ("v2", dict(q_lora_rank=None, mlp_bias=True, tie_word_embeddings=True), 0),
}


def make_deepseek(path: str, name: str) -> str:
    family, overrides, seed = VARIANTS[name]
    config_cls, model_cls = {
        "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)}[family]
    fields = {**DIMS, **overrides}
    # Every layer dense (MoE layers: test_moe_parity.py).
    config = config_cls(first_k_dense_replace=fields["num_hidden_layers"], **fields)
    torch.manual_seed(seed)
    model_cls(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Callable[[str], str]:
    """name -> path of that variant's checkpoint, written once per module."""
    return checkpoint_cache(tmp_path_factory, make_deepseek)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 6, (n,), generator=g).tolist() for n in lengths]


def _reference_model(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference_greedy(model: transformers.PreTrainedModel, prompt: list[int],
                      n: int = 64) -> list[int]:
    """transformers' generate, greedy, one prompt alone (no padding); refuses a path with a
    near-tie, which float32 rounding could flip."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin >= MIN_MARGIN, f"near-tie ({margin:.2e}) on the reference path: pick another seed"
    return out.sequences[0, len(prompt):].tolist()


def _prefill_logits(path: str, prompt: list[int], table: list[int],
                    block_size: int = 16) -> torch.Tensor:
    """Our logits for every prompt token, the prompt's latents paged through `table`."""
    acc = CPUAccelerator()
    acc.init_device()
    acc.load_model(ModelSpec(path, dtype="float32"))
    acc.allocate_kv_cache(max(table) + 1, block_size)
    n = len(prompt)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    batch = ModelBatch(input_ids=prompt, positions=list(range(n)), query_lens=[n], seq_lens=[n],
                       groups=(GroupBatch([table], slots),), sample_indices=[0], sampling=[])
    return acc.forward_logits(batch, all_tokens=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", accelerator="cpu", block_size=16, kv_cache_memory_gb=0.05,
               load_tokenizer=False, **kwargs)


@pytest.mark.parametrize("name, length", [("v3", 45), ("v3_q_proj", 45), ("v3_yarn", 300),
                                          ("v2", 45)])
def test_prefill_logits_match_transformers(checkpoint, name, length):
    path = checkpoint(name)
    prompt = _prompts((length,))[0]  # yarn: well past original_max_position_embeddings (128)
    pages = (length + 15) // 16
    table = [2 * pages - 2 * i for i in range(pages)]  # out of order, with gaps
    ours = _prefill_logits(path, prompt, table)
    with torch.no_grad():
        ref = _reference_model(path)(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name, lengths", [("v3", (5, 23, 41, 64)), ("v3_yarn", (9, 140, 190))])
def test_batched_greedy_matches_transformers(checkpoint, name, lengths):
    path = checkpoint(name)
    prompts = _prompts(lengths, seed=1)
    outs = _llm(path).generate(prompts, GREEDY)
    ref = _reference_model(path)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == _reference_greedy(ref, prompt), f"prompt {i} diverged"


def test_chunked_prefill_and_prefix_hit_match_transformers(checkpoint):
    path = checkpoint("v3_q_proj")
    prompts = _prompts((5, 41, 70), seed=2)
    # A 12-token budget cuts the long prompts into chunks while the short one decodes.
    llm = _llm(path, max_num_batched_tokens=12)
    ref = _reference_model(path)
    expected = [_reference_greedy(ref, p) for p in prompts]
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    again = llm.generate([prompts[2]], GREEDY)[0]  # the same prompt: its pages are cached
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == expected[2]


def test_host_tier_serves_latent_pages(checkpoint):
    # Device pages of a conversation are evicted between turns; with the host tier the hits
    # come back from host memory and the greedy tokens do not change.
    stats = check_host_tier(checkpoint("v3"), CPUAccelerator, vocab=VOCAB - 6)
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0


def test_kv_spec_is_one_latent_per_token():
    config = transformers.DeepseekV3Config(**{**DIMS, "num_hidden_layers": 3},
                                           first_k_dense_replace=3)
    with torch.device("meta"):
        spec = DeepseekV3ForCausalLM(config, None, 1).kv_spec()
    assert spec.num_groups == 1 and spec.groups[0].layers == (0, 1, 2)
    (entry,) = spec.groups[0].kind.entries
    latent = DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"]  # 40, not 2 * 4 heads * 24
    assert entry.name == "latent" and entry.shape == (latent,)
    assert spec.block_bytes(16, 4) == 3 * 16 * latent * 4


def test_deepseek_v2_moe_layers_are_refused():
    config = transformers.DeepseekV2Config(**DIMS, first_k_dense_replace=1, n_routed_experts=4,
                                           num_experts_per_tok=2)
    with torch.device("meta"), pytest.raises(ValueError, match="V2 MoE routing is not supp"):
        DeepseekV3ForCausalLM(config, None, 1)
