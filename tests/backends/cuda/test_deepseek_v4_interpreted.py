"""DeepSeek-V4 on the nvidia backend, run on the CPU under TRITON_INTERPRET=1, against
transformers (the checkpoint, reference and prompts of v4_interpreted.py).

Two prefills of different lengths in one forward; then the engine: two prompts in 48-token
chunks (chunks end inside CSA and HCA windows), greedy decoding across window, CSA and HCA
boundaries (decode-only steps go through the compressed decode and indexer kernels), and a
prefix hit of one page that resumes from the page's stored carry-over. The decode graphs and
speculative decoding: test_deepseek_v4_graphs_interpreted.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.backends.cuda.v4_interpreted import checkpoint, prompts, reference, run_greedy  # noqa: F401
from tests.models.test_deepseek_v4_parity import _logits, _prefill_batch
from tests.models.test_moe_parity import _assert_reference_greedy

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")


def test_prefill_logits_match_transformers(checkpoint, reference, prompts):
    acc = _interpreted_cls()()
    acc.init_device()
    info = acc.load_model(ModelSpec(checkpoint, dtype="float32"))
    assert acc.grouped and info.kv_spec.num_groups == 3
    acc.allocate_kv_cache(6, 128, num_state_slots=2)
    ours = acc.forward_logits(_prefill_batch(info.kv_spec, prompts), all_tokens=True)
    ref = torch.cat([_logits(reference, p) for p in prompts])
    assert (ours - ref).abs().max().item() < 1e-4
    acc.shutdown()


@pytest.fixture(scope="module")
def kernel_calls():
    """Counts of the V4 decode kernels' launches over the module's engine runs."""
    from deepinfer.backends.cuda.kernels import compressed_decode, index_topk

    calls = {"attention": 0, "indexer": 0}
    wrapped = {}
    for module, name, key in ((compressed_decode, "compressed_decode_attention", "attention"),
                              (index_topk, "indexer_topk", "indexer")):
        wrapped[(module, name)] = original = getattr(module, name)

        def counting(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)
        setattr(module, name, counting)
    yield calls
    for (module, name), original in wrapped.items():
        setattr(module, name, original)


@pytest.fixture(scope="module")
def engine(checkpoint):
    config = EngineConfig(model=ModelSpec(checkpoint, dtype="float32"),
                          cache=CacheConfig(block_size=128, num_blocks=10),
                          scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    yield engine
    engine.shutdown()


def test_chunked_batched_greedy_matches_transformers(engine, reference, prompts,
                                                     kernel_calls):
    """150 and 45 tokens: decoding crosses 16-token windows, CSA's 4 and HCA's 32 rates
    (the shorter one's window and CSA end at 48)."""
    outs = run_greedy(engine, prompts, 7, "a")
    for i, prompt in enumerate(prompts):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # 3 layers each decode step (sliding, CSA, HCA); the CSA layer also picks.
    assert kernel_calls["attention"] >= 3 * 5 and kernel_calls["indexer"] >= 5
    assert not engine.kv._slots


def test_prefix_hit_resumes_from_the_page(engine, reference, prompts):
    """A prompt sharing the 150-token prompt's first page hits it and resumes the CSA
    carry-over from the page: transformers' greedy tokens."""
    shared = prompts[0][:128] + prompts[1][:21]
    (tokens, cached), = run_greedy(engine, [shared], 4, "b").values()
    assert cached == 128
    _assert_reference_greedy(reference, shared, tokens)
