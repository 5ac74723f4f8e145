"""Real sliding-window attention against transformers: Mistral with a 48-token window on
prompts several windows long (no context cap at the window), and Qwen3 with `layer_types`
mixing windowed and full layers (two KV groups). The windowed group frees the blocks that fell
out of its window, so a pool far too small for whole sequences still serves them."""
from __future__ import annotations

import pytest
import torch
import transformers
from checkpoints import make_checkpoint

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams

WINDOW = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("mistral")), "mistral",
                           sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    # Layer 0 full, layer 1 windowed (Qwen3's use_sliding_window + max_window_layers=1).
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-hybrid")), "qwen3",
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _engine(path: str, num_blocks: int = 64, budget: int = 2048) -> Engine:
    config = EngineConfig(model=ModelSpec(path, "float32"),
                          cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    return Engine(config, CPUAccelerator(), load_tokenizer=False)


def _run(engine: Engine, prompts: list[list[int]]) -> dict[str, tuple[list[int], int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.token_ids), out.num_cached_tokens)
    assert engine.kv.num_request_blocks() == 0
    return done


def _reference(path: str, prompt: list[int], n: int = 64) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 250, (n,), generator=g).tolist() for n in lengths]


def test_kv_spec_declares_the_window(mistral_dir, hybrid_dir):
    from deepinfer.models.registry import kv_spec_of

    mistral = kv_spec_of(mistral_dir)
    assert [g.sliding_window for g in mistral.groups] == [WINDOW]
    hybrid = kv_spec_of(hybrid_dir)
    assert [(g.layers, g.sliding_window) for g in hybrid.groups] == [((0,), None),
                                                                      ((1,), WINDOW)]


def test_prefill_logits_match_transformers_past_the_window(mistral_dir):
    prompt = _prompts((300,))[0]
    acc = CPUAccelerator()
    acc.load_model(ModelSpec(mistral_dir, "float32"))
    acc.allocate_kv_cache(32, 16)
    from deepinfer.core.batch import GroupBatch, ModelBatch

    table = list(range(31, 12, -1))  # 19 blocks, out of order
    slots = [table[p // 16] * 16 + p % 16 for p in range(300)]
    batch = ModelBatch(prompt, list(range(300)), [300], [300], (GroupBatch([table], slots),),
                       [0], [])
    ours = acc.forward_logits(batch, all_tokens=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("budget", [2048, 40])  # whole prompts, then chunks under the window
def test_batched_greedy_on_prompts_several_windows_long(mistral_dir, budget):
    prompts = _prompts((300, 90, 17), seed=1)
    done = _run(_engine(mistral_dir, budget=budget), prompts)
    for i, p in enumerate(prompts):
        assert done[str(i)][0] == _reference(mistral_dir, p), f"prompt {i} diverged"


def test_a_pool_smaller_than_one_sequence_serves_it(mistral_dir):
    # 12 usable blocks of 16 hold 192 tokens; 300 + 64 tokens fit because the window group
    # keeps only the blocks the next query can see (48 tokens + the chunk being computed).
    prompt = _prompts((300,), seed=2)[0]
    engine = _engine(mistral_dir, num_blocks=13, budget=64)
    assert engine.token_limit() == engine.max_model_len  # no cap at the pool, nor the window
    assert _run(engine, [prompt])["0"][0] == _reference(mistral_dir, prompt)


def test_prefix_hit_needs_only_the_window(mistral_dir):
    shared = _prompts((200,), seed=3)[0]
    engine = _engine(mistral_dir)
    _run(engine, [shared + [5, 6, 7]])
    tokens, cached = _run(engine, [shared + [9, 10]])["0"]
    assert cached == 192  # 12 full pages of 16, though only the last 3-4 are still needed
    assert tokens == _reference(mistral_dir, shared + [9, 10])


def test_hybrid_layers_match_transformers(hybrid_dir):
    prompts = _prompts((150, 33), seed=4)
    engine = _engine(hybrid_dir, budget=40)
    assert len(engine.kv.groups) == 2
    done = _run(engine, prompts)
    for i, p in enumerate(prompts):
        assert done[str(i)][0] == _reference(hybrid_dir, p), f"prompt {i} diverged"


def test_the_window_changes_the_tokens(mistral_dir, tmp_path):
    """The comparisons above can fail: without its window the same weights decode otherwise."""
    prompt = _prompts((300, 90, 17), seed=1)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    model.config.sliding_window = None
    model.save_pretrained(str(tmp_path))
    assert _reference(str(tmp_path), prompt) != _reference(mistral_dir, prompt)


def test_host_tier_serves_windowed_layers(hybrid_dir):
    """HiCache on and off give the same tokens over a conversation whose device pages are
    evicted between turns, with hits from the host: the full group's pages all come back, the
    windowed group's only where its window reads at the hit's end."""
    from deepinfer.testing.hicache import check_host_tier

    assert check_host_tier(hybrid_dir, CPUAccelerator, vocab=250).host_hit_tokens > 0
