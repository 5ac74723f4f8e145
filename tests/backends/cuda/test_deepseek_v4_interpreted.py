"""DeepSeek-V4 on the nvidia backend, run on the CPU under TRITON_INTERPRET=1, against
transformers: the checkpoint of tests/models/test_deepseek_v4_parity.py (a sliding, a CSA and
an HCA layer; window 16, HCA rate 32, indexer top-8) with a 512-token vocabulary so the
interpreter gets through the LM head quickly.

Two prefills of different lengths in one forward; then the engine: two prompts in 48-token
chunks (chunks end inside CSA and HCA windows), greedy decoding across window, CSA and HCA
boundaries (decode-only steps go through the compressed decode and indexer kernels), and a
prefix hit of one page that resumes from the page's stored carry-over.
"""
from __future__ import annotations

import os

import pytest
import torch

from deepinfer.backends.cuda import accelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.checkpoints import checkpoint_cache
from tests.models.test_deepseek_v4_parity import _logits, _prefill_batch, make_v4
from tests.models.test_moe_parity import _assert_reference_greedy

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return checkpoint_cache(tmp_path_factory, lambda path, name: make_v4(
        path, name, vocab_size=VOCAB))("v4-small-vocab")


@pytest.fixture(scope="module")
def reference(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (150, 45)]


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


def _run(engine: Engine, prompts: list[list[int]], new: int, tag: str) -> dict[str, tuple]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = (list(out.token_ids), out.num_cached_tokens)
    return {i: got[f"{tag}{i}"] for i in range(len(prompts))}


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
    """150 and 45 tokens: decoding crosses 16-token windows, CSA's 4 and HCA's 32 rates."""
    outs = _run(engine, prompts, 10, "a")
    for i, prompt in enumerate(prompts):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # 3 layers each decode step (sliding, CSA, HCA); the CSA layer also picks.
    assert kernel_calls["attention"] >= 3 * 5 and kernel_calls["indexer"] >= 5
    assert not engine.kv._slots


def test_prefix_hit_resumes_from_the_page(engine, reference, prompts):
    """A prompt sharing the 150-token prompt's first page hits it and resumes the CSA
    carry-over from the page: transformers' greedy tokens."""
    shared = prompts[0][:128] + prompts[1][:21]
    (tokens, cached), = _run(engine, [shared], 6, "b").values()
    assert cached == 128
    _assert_reference_greedy(reference, shared, tokens)


def test_other_models_with_several_groups_are_refused(tmp_path):
    """Only a model that reads every group's tables (DeepSeek-V4) gets the grouped steps: a
    Qwen3 with sliding and full layers (two groups) is a clear error, not a wrong answer."""
    from tests.checkpoints import make_checkpoint

    # Layer 0 full, layer 1 windowed (as tests/models/test_sliding_window.py's hybrid).
    path = make_checkpoint(str(tmp_path / "hybrid"), "qwen3", use_sliding_window=True,
                           sliding_window=32, max_window_layers=1)
    acc = _interpreted_cls()()
    acc.init_device()
    with pytest.raises(ValueError, match="one KV group"):
        acc.load_model(ModelSpec(path, dtype="float32"))
    acc.shutdown()


@pytest.fixture(scope="module")
def graph_engine(checkpoint):
    """An engine whose decode steps go through the decode graphs' path: without a GPU each
    step records its graph afresh from the graph's row buffer (graphs.DecodeGraphs)."""
    config = EngineConfig(model=ModelSpec(checkpoint, dtype="float32"),
                          cache=CacheConfig(block_size=128, num_blocks=12),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    with pytest.MonkeyPatch.context() as mp:
        # Two context classes: the three sequences' first steps (<= 160 tokens) in the short
        # one, the rest in the full one.
        mp.setattr(accelerator, "CONTEXT_CLASSES", (160,))
        engine.accelerator.capture_graphs(128)
    yield engine
    engine.shutdown()


def test_decode_graph_path_matches_transformers(graph_engine, reference, prompts):
    """Three sequences in the 4-row bucket (one padding row, its state in the extra slot)
    decode across CSA and HCA window closes and, the 120-token one, its first page end, where
    the decode step stores the CSA carry-over in the page; a later prompt hits that page and
    resumes from it. Every answer is transformers' greedy one."""
    acc = graph_engine.accelerator
    recorded = []
    record = acc.graphs.record
    acc.graphs.record = lambda forward, n, context: recorded.append((n, context)) or \
        record(forward, n, context)
    third = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    batch = [prompts[0], prompts[1], third]
    outs = _run(graph_engine, batch, 12, "g")
    for i, prompt in enumerate(batch):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # Three sequences in the 4-row bucket (a padding row ran), in both context classes.
    assert {(4, 160), (4, 1024)} <= set(recorded)
    assert acc.cache.state.shape[0] == 4 + 1
    # The third sequence's first page was completed by decode steps: its page_state entry.
    follow = third + outs[2][0][:8] + prompts[1][:10]
    (tokens, cached), = _run(graph_engine, [follow], 4, "h").values()
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


def test_mtp_verify_steps_run_as_decode_rows(checkpoint, reference, prompts, tmp_path):
    """Speculative decoding with the MTP layer: each verify step runs its 1 + 2 tokens per sequence as decode rows through
    the compressor and attention kernels, and the answers stay transformers' greedy ones."""
    from deepinfer.backends.cuda.kernels import compress_decode

    engine = _mtp_engine(checkpoint, tmp_path)
    rows = []
    original = compress_decode.compress_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compress_decode, "compress_decode",
                   lambda comp, kv, *a: rows.append(kv.shape[0]) or original(comp, kv, *a))
        outs = _run(engine, prompts, 8, "m")
    for i, prompt in enumerate(prompts):
        _assert_reference_greedy(reference, prompt, outs[i][0])
    # Verify steps of both sequences: token j of each at once, through the kernel.
    assert engine.scheduler.spec_stats.draft_tokens > 0 and rows.count(2) >= 3 * 2
    assert not engine.kv._slots and engine.kv.num_request_blocks() == 0
    engine.shutdown()


def test_mtp_graph_path_matches_transformers(checkpoint, reference, prompts, tmp_path):
    """The same through speculative decoding's graphs (spec_graphs.py, each recorded afresh
    without a GPU): verify rows, the draft layer over them, its one-token steps."""
    engine = _mtp_engine(checkpoint, tmp_path)
    acc = engine.accelerator
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accelerator, "CONTEXT_CLASSES", (160,))
        acc.capture_graphs(128)
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
        outs = _run(engine, prompts, 8, "s")
    for i, prompt in enumerate(prompts):
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
