"""DeepSeek-V4's decode graphs and speculative decoding (its MTP layer) on the nvidia backend,
run on the CPU under TRITON_INTERPRET=1, against transformers (the checkpoint, reference and
prompts of v4_interpreted.py). Without a GPU each graph is recorded afresh at every run, from
the same row buffers a replay reads.

The prompts here are short where no page end needs crossing (the speculative ones: 45 and 28
tokens, decoding across a sliding window's end, CSA windows and an HCA window), since the
interpreter's cost grows with every prompt token.
"""
from __future__ import annotations

import os

import pytest

from deepinfer.backends.cuda import accelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.backends.cuda.v4_interpreted import (  # noqa: F401
    checkpoint,
    prompts,
    random_prompt,
    reference,
    run_greedy,
)
from tests.models.test_moe_parity import _assert_reference_greedy

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")


# Decoding reaches positions 47 and 31 of the short prompts, whose windows close there.
MTP_TOKENS = 5


@pytest.fixture(scope="module")
def short_prompts(prompts) -> list[list[int]]:
    """45 tokens (decoding crosses the window and CSA end at 48) and 28 (the HCA and window
    end at 32)."""
    return [prompts[1], random_prompt(28, seed=7)]


@pytest.fixture(scope="module")
def graph_engine(checkpoint):
    """An engine whose decode steps go through the decode graphs' path: without a GPU each
    step records its graph afresh from the graph's row buffer (graphs.DecodeGraphs)."""
    config = EngineConfig(model=ModelSpec(checkpoint, dtype="float32"),
                          cache=CacheConfig(block_size=128, num_blocks=12),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    with pytest.MonkeyPatch.context() as mp:
        # Two context classes: the steps while every sequence is within its first page
        # (<= 128 tokens) in the short one, the rest in the full one.
        mp.setattr(accelerator, "CONTEXT_CLASSES", (128,))
        engine.accelerator.record_graphs()
    yield engine
    engine.shutdown()


def test_decode_graph_path_matches_transformers(graph_engine, reference, short_prompts):
    """Three sequences in the 4-row bucket (one padding row, its state in the extra slot)
    decode across CSA and HCA window closes and, the 125-token one, its first page end, where
    the decode step stores the CSA carry-over in the page and the batch moves to the full
    context class (125 tokens and 5 answers: as few decode steps as reach it); a later prompt
    hits that page and resumes from it. Every answer is transformers' greedy one."""
    acc = graph_engine.accelerator
    recorded = []
    record = acc.graphs.record
    acc.graphs.record = lambda forward, n, context: recorded.append((n, context)) or \
        record(forward, n, context)
    # The long one first: it prefills first, so its decode steps past its page end still run
    # beside the other two's.
    long = random_prompt(125, seed=5)
    batch = [long, *short_prompts]
    # 5 tokens: the long one's decode steps run up to position 128, past its page end, and the
    # short ones' past their window ends at 48 and 32.
    outs = run_greedy(graph_engine, batch, 5, "g")
    for i, prompt in enumerate(batch):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # Three sequences in the 4-row bucket (a padding row ran), in both context classes.
    assert {(4, 128), (4, 1024)} <= set(recorded)
    assert acc.cache.state.shape[0] == 4 + 1
    # The long sequence's first page was completed by decode steps: its page_state entry.
    follow = long + outs[0][0][:3] + short_prompts[0][:10]
    (tokens, cached), = run_greedy(graph_engine, [follow], 4, "h").values()
    assert cached == 128
    _assert_reference_greedy(reference, follow, tokens)
    assert not graph_engine.kv._slots


def _mtp_engine(checkpoint: str, tmp_path) -> Engine:
    """The checkpoint with a random MTP layer (its drafts are mostly rejected, so the state
    rewinds run), speculating 2 tokens a step."""
    import shutil

    from tests.models.v4_mtp_checkpoints import add_v4_mtp

    path = str(tmp_path / "v4-mtp")
    shutil.copytree(checkpoint, path)
    add_v4_mtp(path, seed=5)
    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=128, num_blocks=12),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                                    num_speculative_tokens=2))
    return Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)


def test_mtp_verify_steps_run_as_decode_rows(checkpoint, reference, short_prompts,
                                             tmp_path):
    """Speculative decoding with the MTP layer: each verify step runs its 1 + 2 tokens per
    sequence as decode rows through the compressor and attention kernels, and the answers
    stay transformers' greedy ones."""
    from deepinfer.backends.cuda.kernels import compress_decode

    engine = _mtp_engine(checkpoint, tmp_path)
    rows = []
    original = compress_decode.compress_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compress_decode, "compress_decode",
                   lambda comp, kv, *a: rows.append(kv.shape[0]) or original(comp, kv, *a))
        outs = run_greedy(engine, short_prompts, MTP_TOKENS, "m")
    for i, prompt in enumerate(short_prompts):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # Verify steps of both sequences: token j of each at once, through the kernel.
    assert engine.scheduler.spec_stats.draft_tokens > 0 and rows.count(2) >= 3 * 2
    assert not engine.kv._slots and engine.kv.num_request_blocks() == 0
    engine.shutdown()


def test_mtp_graph_path_matches_transformers(checkpoint, reference, short_prompts,
                                             tmp_path):
    """The same through speculative decoding's graphs (spec_graphs.py, each recorded afresh
    without a GPU): verify rows, the draft layer over them, its one-token steps."""
    engine = _mtp_engine(checkpoint, tmp_path)
    acc = engine.accelerator
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accelerator, "CONTEXT_CLASSES", (160,))
        acc.record_graphs()
    runs = {name: [] for name in ("verify", "draft", "step")}
    for name, calls in runs.items():
        graphs = getattr(acc.speculator, name)
        record = graphs.record
        graphs.record = lambda forward, n, context, _r=record, _c=calls: _c.append(n) or \
            _r(forward, n, context)
    eager = []
    with pytest.MonkeyPatch.context() as mp:
        from deepinfer.backends.cuda import spec_graphs

        execute = spec_graphs.MTPSpeculator.execute
        mp.setattr(spec_graphs.MTPSpeculator, "execute",
                   lambda self, batch: eager.append(_decodes_only(batch)) or execute(self, batch))
        outs = run_greedy(engine, short_prompts, MTP_TOKENS, "s")
    for i, prompt in enumerate(short_prompts):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    assert engine.scheduler.spec_stats.draft_tokens > 0
    # Two sequences: 2 x 3 verify rows (bucket 8), the draft over them, 2-row draft steps;
    # the last steps' fewer drafts (max_tokens) padded into the same graphs: only steps with
    # a prefill chunk ran eagerly.
    assert 8 in runs["verify"] and 8 in runs["draft"] and 2 in runs["step"]
    assert eager and not any(eager)
    assert not engine.kv._slots and engine.kv.num_request_blocks() == 0
    engine.shutdown()


def _decodes_only(batch) -> bool:
    """Every sequence of the step decodes (its query: its last token and its drafts)."""
    drafts = [len(d) for d in batch.spec.draft_token_ids]
    return len(batch.sample_indices) == batch.num_seqs and all(
        q == d + 1 for q, d in zip(batch.query_lens, drafts))
