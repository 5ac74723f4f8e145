"""DeepSeek-V4 on PyTorch/XLA's CPU device: its attention block in static shapes
(models/deepseek_v4/static.py: compressors, page carry-over, state slots, indexer top-k) traced
once per bucket and compiled once at start-up; chunked, batched prompts and a prefix hit that
resumes the CSA carry-over from a page compile nothing more and sync nothing mid-step (the
audit raises otherwise); every greedy token is transformers' argmax. The checkpoint and its
real-text prompts are test_deepseek_v4_parity.py's."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

from deepinfer.backends.neuron.xla_audit import xla_counts  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402
from tests.models.test_deepseek_v4_parity import make_v4, prompts  # noqa: E402,F401
from tests.models.test_moe_parity import _assert_reference_greedy, _reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("xla_device")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# V4's pages are 128 tokens. Buckets: tokens 16; batches 1, 2; context 1, 2 pages: 6 graphs.
SHAPES = dict(dtype="float32", accelerator="neuron", block_size=128, num_blocks=8,
              max_num_batched_tokens=16, max_num_seqs=2, max_model_len=256)


def test_one_compile_per_bucket_and_greedy_equals_transformers(tmp_path_factory,
                                                              prompts):  # noqa: F811
    # Five Sinkhorn iterations of mHC instead of 20: the same ops in a smaller graph (each
    # iteration is unrolled into every layer's two collapses), which compiles faster.
    path = make_v4(str(tmp_path_factory.mktemp("v4")), hc_sinkhorn_iters=5)
    before = xla_counts()
    llm = LLM(path, load_tokenizer=False, **SHAPES)
    acc = llm.engine.accelerator
    started = xla_counts()
    plan = acc.graph_plan()
    assert len(plan) == 6 and [g["compiles"] for g in acc.graph_report] == [1] * len(plan)
    assert started.compiles - before.compiles == len(plan) + 1  # + the weights and the pool
    short, long = prompts[0], prompts[1]  # 41 and 150 tokens: 3 and 10 chunks
    outs = [list(o.outputs[0].token_ids) for o in llm.generate([short, long], GREEDY)]
    # Its first page cached: the chunk after it starts at a page end with an empty slot.
    shared = long[:128] + short[:30]
    hit = llm.generate([shared], GREEDY)[0]
    done = xla_counts().minus(started)
    assert done.compiles == 0, "a graph compiled after start-up"
    assert acc.audit.steps > 0 and done.from_device == acc.audit.steps
    assert hit.num_cached_tokens == 128
    model = _reference(path)
    for prompt, out in zip([short, long, shared], outs + [list(hit.outputs[0].token_ids)]):
        _assert_reference_greedy(model, prompt, out)
