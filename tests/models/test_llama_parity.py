"""The llama family on the CPU backend against transformers on random-weight checkpoints."""
from __future__ import annotations

import pytest
import torch
import transformers
from checkpoints import make_checkpoint

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _engine(path: str, dtype: str = "float32", block_size: int = 16, num_blocks: int = 128,
            budget: int = 2048, caching: bool = True) -> Engine:
    config = EngineConfig(model=ModelSpec(path, dtype),
                          cache=CacheConfig(block_size, num_blocks, enable_prefix_caching=caching),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    return Engine(config, CPUAccelerator(), load_tokenizer=False)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
         ) -> dict[str, tuple[list[int], int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.token_ids), out.num_cached_tokens)
    return done


def _reference_greedy(path: str, prompt: list[int], n: int, dtype=torch.float32) -> list[int]:
    """Greedy decoding with transformers' own KV cache; no EOS handling (like ignore_eos)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(n):
            result = model(ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            ids = result.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


def _prefill_logits(path: str, prompt: list[int], table: list[int], block_size: int,
                    num_blocks: int, dtype: str = "float32") -> torch.Tensor:
    """Our logits for every prompt token, the prompt's KV paged through `table`."""
    acc = CPUAccelerator()
    acc.load_model(ModelSpec(path, dtype))
    acc.allocate_kv_cache(num_blocks, block_size)
    n = len(prompt)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    batch = ModelBatch(prompt, list(range(n)), [n], [n], (GroupBatch([table], slots),), [0], [])
    return acc.forward_logits(batch, all_tokens=True)


def _reference_logits(path: str, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def _prompts(lengths: tuple[int, ...], seed: int = 0, vocab: int = 250) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_prefill_logits_match_transformers(tmp_path, family):
    path = make_checkpoint(str(tmp_path), family)
    prompt = _prompts((37,))[0]
    # Five pages, non-contiguous and out of order: paging must not matter.
    ours = _prefill_logits(path, prompt, [9, 3, 12, 5, 7], block_size=8, num_blocks=16)
    assert (ours - _reference_logits(path, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_greedy_matches_transformers(tmp_path, family):
    path = make_checkpoint(str(tmp_path), family)
    prompts = _prompts((5, 23, 41, 64))
    done = _run(_engine(path), prompts)
    for i, p in enumerate(prompts):
        assert done[str(i)][0] == _reference_greedy(path, p, 64), f"prompt {i} diverged"


def test_chunked_prefill_matches_transformers(llama_dir):
    # A 12-token budget cuts the 41- and 64-token prompts into several chunks while the
    # short prompt is already decoding beside them.
    prompts = _prompts((5, 41, 64), seed=1)
    engine = _engine(llama_dir, budget=12)
    done = _run(engine, prompts)
    for i, p in enumerate(prompts):
        assert done[str(i)][0] == _reference_greedy(llama_dir, p, 64)


def test_prefix_cache_hit_gives_reference_tokens(llama_dir):
    shared = _prompts((40,), seed=2)[0]  # 2.5 pages of 16
    first, second = shared + [7, 8, 9], shared + [11, 12]
    engine = _engine(llama_dir)
    assert _run(engine, [first])["0"][1] == 0
    tokens, cached = _run(engine, [second])["0"]
    assert cached == 32  # the two full shared pages
    assert tokens == _reference_greedy(llama_dir, second, 64)
    assert engine.kv.stats.hits == 32


def test_bf16_runs_close_to_transformers_bf16(tmp_path):
    path = make_checkpoint(str(tmp_path), "llama", dtype=torch.bfloat16)
    acc = CPUAccelerator()
    acc.load_model(ModelSpec(path, "auto"))
    assert acc.runner.dtype == torch.bfloat16
    acc.allocate_kv_cache(8, 8)
    prompt = _prompts((20,))[0]
    slots = [(1 + p // 8) * 8 + p % 8 for p in range(20)]
    batch = ModelBatch(prompt, list(range(20)), [20], [20], (GroupBatch([[1, 2, 3]], slots),),
                       [0], [])
    ours = acc.forward_logits(batch, all_tokens=True)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0].float()
    # bf16 keeps ~3 significant digits; compare relative to the logit scale.
    assert (ours - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
     "rope_theta": 10000.0},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    path = make_checkpoint(str(tmp_path), "llama", rope_parameters=rope)
    prompt = _prompts((150,), seed=3)[0]  # beyond the original 64 positions
    ours = _prefill_logits(path, prompt, list(range(1, 11)), block_size=16, num_blocks=12)
    assert (ours - _reference_logits(path, prompt)).abs().max().item() < 1e-4
