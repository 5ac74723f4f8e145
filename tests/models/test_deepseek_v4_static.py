"""DeepSeek-V4 in static shapes (models/deepseek_v4/static.py) on the Neuron backend's host
device (DEEPINFER_NEURON_DEVICE=cpu), against transformers' DeepseekV4ForCausalLM on the tiny
checkpoint of test_deepseek_v4_parity.py: batched prompts in 48-token chunks (chunks end inside
CSA and HCA windows, pages end mid-chunk), decoding in padded batch buckets, prefix hits that
resume the CSA carry-over from a page, every step in a graph built at start-up."""
from __future__ import annotations

import pytest

from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.models.test_deepseek_v4_parity import prompts  # noqa: F401 - the fixture
from tests.models.test_moe_parity import _assert_reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "cpu")


@pytest.fixture(scope="module")
def neuron_run(v4_checkpoint, prompts):  # noqa: F811 - the fixture
    with pytest.MonkeyPatch.context() as patch:  # module scope: the autouse one is not yet
        patch.setenv("DEEPINFER_NEURON_DEVICE", "cpu")
        llm = LLM(v4_checkpoint, dtype="float32", accelerator="neuron", num_blocks=12,
                  load_tokenizer=False, max_num_batched_tokens=48, max_num_seqs=4,
                  max_model_len=512)
    graphs = llm.engine.accelerator.guard.num_graphs
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    return llm, graphs, outs


def test_batched_chunked_greedy_matches_transformers(neuron_run, v4_reference, prompts):  # noqa: F811
    llm, graphs, outs = neuron_run
    acc = llm.engine.accelerator
    assert graphs == len(acc.shapes.graphs()) and acc.guard.frozen
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(v4_reference, prompt, list(out))
    assert acc.guard.num_graphs == graphs  # every step in a graph built at start-up
    kv = llm.engine.kv
    assert not kv._slots and len(kv._free_slots) == llm.engine.config.scheduler.max_num_seqs


def test_prefix_hits_resume_from_the_page(neuron_run, v4_reference, prompts):  # noqa: F811
    """Requests sharing 2 and 1 pages with the finished 263-token prompt start at a page end
    with an empty state slot: the CSA carry-over comes from the hit's last page."""
    llm, graphs, _ = neuron_run
    long, other = prompts[2], prompts[0]
    shared = [long[:256] + other[:20], long[:128] + other[:30]]
    outs = llm.generate(shared, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [256, 128]
    for prompt, out in zip(shared, outs):
        _assert_reference_greedy(v4_reference, prompt, list(out.outputs[0].token_ids))
    assert llm.engine.accelerator.guard.num_graphs == graphs
