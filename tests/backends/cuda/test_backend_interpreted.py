"""The CUDA backend end to end on the CPU: its Triton kernels under TRITON_INTERPRET=1, composed
by the same CUDAAccelerator code that runs on a GPU (minus graphs), against transformers.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.testing.conformance import AcceleratorConformance

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")


def _interpreted_cls():
    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    class InterpretedCUDA(CUDAAccelerator):
        """CUDAAccelerator on CPU tensors; the probe says yes so the suite can select it.
        The UVA page copy needs a GPU (checked on the device by benchmarks/cuda)."""

        capabilities = dataclasses.replace(CUDAAccelerator.capabilities, host_page_copy=False)

        def __init__(self) -> None:
            super().__init__(device="cpu")

        @classmethod
        def is_available(cls) -> bool:
            return True

    return InterpretedCUDA


class TestConformance(AcceleratorConformance):
    accelerator_cls = staticmethod(_interpreted_cls)  # resolved in setup_class

    @classmethod
    def setup_class(cls) -> None:
        cls.accelerator_cls = _interpreted_cls()
        super().setup_class()


def _count_expanded_prefills(monkeypatch) -> list[int]:
    """A list that grows by one at each expanded MLA prefill the CUDA ops run."""
    from deepinfer.backends.cuda import ops as cuda_ops

    calls: list[int] = []
    real = cuda_ops.mla_expanded_prefill

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda_ops, "mla_expanded_prefill", counted)
    return calls


def _greedy_round(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                  round_: int) -> list[list[int]]:
    """The prompts submitted together, stepped to the end: each one's tokens, in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{round_}-{i}", prompt, params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.token_ids)
    return [got[f"{round_}-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_windowed", "deepseek_v3"])
def test_engine_greedy_equals_transformers(tmp_path, monkeypatch, family):
    """Chunked prefill (16-token budget over a 16-token block size), mixed prefill + decode
    steps (their decodes through the decode kernel), then a second round that hits the prefix
    cache (the 75-token prompt's last chunk over its cached 64 runs split-K): every greedy
    token equals transformers' generate in float32. The prefix cache's path is the same for
    every family (and round 1's later chunks already attend over cached pages), so qwen3
    runs round 1 only. qwen3_windowed: a full layer and a 24-token sliding layer, two KV
    groups (the sliding group frees the pages that leave its window), each layer reading its
    group's tables (LayerGroupMeta); it runs the prefix-hit round too. deepseek_v3 (MLA): the
    prompts' chunks run expanded (kernels/mla_prefill.py), a context longer than the 16-token
    budget decompressed in pieces of at most 16 rows, the decodes absorbed.
    The vocabulary and MLP are narrower than make_checkpoint's and the answers short: the
    interpreter runs a one-row projection (the GEMV, test_one_token_steps_run_the_gemv) as one
    program per few output rows."""
    import transformers

    from tests.checkpoints import make_checkpoint

    windowed = dict(use_sliding_window=True, sliding_window=24, max_window_layers=1) \
        if family == "qwen3_windowed" else {}
    path = make_checkpoint(str(tmp_path / family), family.removesuffix("_windowed"),
                           torch.float32, vocab_size=128, eos_token_id=127,
                           intermediate_size=64, **windowed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 127, (n,), generator=g).tolist() for n in (5, 19, 37, 75)]
    new = 4
    expected = [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]

    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    assert len(engine.kv.groups) == (2 if windowed else 1)
    expanded = _count_expanded_prefills(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for round_ in range(1 if family == "qwen3" else 2):
        assert _greedy_round(engine, prompts, params, round_) == expected, f"round {round_}"
    assert (len(expanded) > 0) == (family == "deepseek_v3")
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    engine.shutdown()


def test_short_chunks_of_one_sequence_run_the_prefill_graphs(tmp_path, monkeypatch):
    """Prefill graphs (without a GPU recorded afresh from the static buffer a replay reads):
    a prompt alone, then again behind a prefix hit (its last chunk over the cached pages), then
    beside another prompt (eager, two sequences): every greedy token equals transformers', and
    the lone chunks went through the graphs, padded to their buckets."""
    import transformers

    from deepinfer.backends.cuda.prefill_graphs import PrefillGraphs
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path / "llama"), "llama", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    first, second = (torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 23))
    new = 3  # the graphs run the prefill steps; the decode steps are the eager ones
    expected = {tuple(p): model.generate(torch.tensor([p]), max_new_tokens=new,
                                         min_new_tokens=new, do_sample=False,
                                         pad_token_id=0)[0, len(p):].tolist()
                for p in (first, second)}
    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    engine.accelerator.record_graphs()
    assert engine.accelerator.prefill_graphs.buckets == (16, 32, 64)
    chunks = []
    run = PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch: chunks.append(
        (batch.num_tokens, batch.seq_lens[0])) or run(self, batch))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for round_, prompts in enumerate([[first], [first], [first, second]]):
        assert _greedy_round(engine, prompts, params, round_) == \
            [expected[tuple(p)] for p in prompts], f"round {round_}"
    # The prompt (40 tokens, bucket 64); its last 8 tokens over 32 cached (bucket 16).
    assert chunks[:2] == [(40, 40), (8, 40)]
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    engine.shutdown()


def test_prompt_logprobs_run_eagerly_and_equal_transformers(tmp_path, monkeypatch):
    """A lone prompt that the prefill graphs would take, asking for prompt_logprobs: its step
    runs eagerly (a graph keeps only the last row's logits), and each prompt token's logprob
    and top 2 equal log_softmax of transformers' logits at the position before it."""
    import transformers

    from deepinfer.backends.cuda.prefill_graphs import PrefillGraphs
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path / "llama"), "llama", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    engine.accelerator.record_graphs()
    graphed = []
    run = PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run",
                        lambda self, batch: graphed.append(batch) or run(self, batch))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                   prompt_logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert graphed == []
    entries = outs[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert [v for _, v in entry.top] == pytest.approx(ref[i - 1].topk(2).values.tolist(),
                                                          abs=1e-4)
    assert outs[0].new_token_ids == [int(ref[-1].argmax())]
    engine.shutdown()


def test_one_token_steps_run_the_gemv(tmp_path, monkeypatch):
    """A lone request decodes one row a step: its projections and LM head go through the GEMV
    kernel (counted), and its greedy tokens still equal transformers'."""
    import transformers

    from deepinfer.backends.cuda import ops as cuda_ops
    from tests.checkpoints import make_checkpoint

    calls = []
    kernel = cuda_ops.gemv
    monkeypatch.setattr(cuda_ops, "gemv", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    path = make_checkpoint(str(tmp_path / "m"), "llama", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt, new = [5, 17, 99, 3, 250, 41, 7], 5
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    config = EngineConfig(model=ModelSpec(path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=8))
    engine = Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    engine.add_request("solo", prompt, params)
    got = []
    while engine.has_unfinished_requests():
        got += [list(out.token_ids) for out in engine.step() if out.finished]
    assert got == [expected]
    # Four projections a layer, every decode step, plus the LM head on every step (the
    # prefill's too: it computes logits of one row).
    layers = model.config.num_hidden_layers
    assert len(calls) == 4 * layers * (new - 1) + new
    engine.shutdown()


def test_decode_rows_equal_eager_inputs(tmp_path):
    """What a decode graph records (the row buffer unpacked with the ids of the step in flight,
    padded rows, the argmax at the end) gives the eager path's logits and their argmax."""
    from deepinfer.backends.cuda.graphs import DecodeGraphs
    from deepinfer.backends.cuda.step_inputs import DecodeRows, fill_decode_rows
    from deepinfer.core.batch import InputsFromLastStep
    from deepinfer.testing.conformance import BLOCK_SIZE, BlockPool, Chunk, Seq, build_batch
    from tests.checkpoints import make_checkpoint

    acc = _interpreted_cls()()
    acc.init_device()
    acc.load_model(ModelSpec(make_checkpoint(str(tmp_path / "m"), "llama"), dtype="float32"))
    acc.allocate_kv_cache(64, BLOCK_SIZE)
    pool = BlockPool(64)
    seqs = [Seq(str(i), list(range(3, 3 + n)), pool.take(n + 4)) for i, n in enumerate((5, 11))]
    acc.execute(build_batch([Chunk(s, len(s.prompt)) for s in seqs]))
    for s in seqs:
        s.computed, s.outputs = len(s.prompt), [7]
    batch = build_batch([Chunk(s) for s in seqs])
    eager = acc.forward_logits(batch)
    # Two padding rows.
    graphs = DecodeGraphs(4, DecodeRows(8, BLOCK_SIZE, lambda b: 2), torch.device("cpu"))
    graphs.tokens[:3] = torch.tensor([5, 7, 9])  # the step in flight sampled 7 for seq 1
    in_flight = InputsFromLastStep(token_indices=[1], rows=[1], source=None)
    batch_ids = list(batch.input_ids)
    pending = dataclasses.replace(batch, input_ids=[batch_ids[0], 0], from_last_step=in_flight)
    rows = graphs.host_rows[0].numpy()
    fill_decode_rows(rows, pending, BLOCK_SIZE)
    graphs.rows.copy_(graphs.host_rows[0])
    with torch.inference_mode():
        forward = lambda inputs, n: acc.model.compute_logits(acc._forward(inputs))  # noqa: E731
        from_rows = graphs.record(forward, 4, 0)[:2]
    torch.testing.assert_close(from_rows, eager, rtol=1e-5, atol=1e-5)
    assert graphs.tokens[:2].tolist() == eager.argmax(dim=-1).tolist()
    acc.shutdown()


def test_profile_batch_stays_inside_the_context():
    """The memory-profiling step covers the whole token budget without a position past the
    rotary tables, and every token gets its own slot outside the null block."""
    from deepinfer.backends.cuda.dummy_batches import profile_batch

    batch = profile_batch(tokens=300, max_len=128, block_size=16)
    assert batch.num_tokens == 300 and batch.query_lens == [128, 128, 44]
    assert max(batch.positions) == 127
    assert len(set(batch.slot_mapping)) == 300 and min(batch.slot_mapping) >= 16
    assert batch.sample_indices == [0, 1, 2] and len(batch.sampling) == 3


def test_graph_logits_keep_only_the_sampled_rows():
    """A replayed graph gives one row per sequence; a dummy step (one padding sequence, as a
    lockstep rank with no request runs) samples none of them."""
    from deepinfer.backends.cuda.accelerator import sampled_rows
    from deepinfer.core.padding import dummy_batch

    logits = torch.arange(12.0).view(3, 4)
    dummy = dummy_batch(1, 16)
    assert sampled_rows(logits[:1], dummy).shape == (0, 4)
    batch = dataclasses.replace(dummy, input_ids=[5, 6, 7], positions=[0, 0, 0],
                                query_lens=[1, 1, 1], seq_lens=[1, 1, 1], sample_indices=[0, 2],
                                num_padding_seqs=0)
    assert torch.equal(sampled_rows(logits, batch), logits[[0, 2]])
    everyone = dataclasses.replace(batch, sample_indices=[0, 1, 2])
    assert sampled_rows(logits, everyone) is logits


def test_a_store_follows_the_newest_step_the_host_has_read():
    """Under async scheduling a store is issued while the next step runs: it follows the end
    of the newest launched step whose tokens were read, not the stream (None: no such step,
    or a step since that execute() ran to its end)."""
    from types import SimpleNamespace

    from deepinfer.backends.cuda.accelerator import CUDAAccelerator

    acc = CUDAAccelerator()
    assert acc._read_upto() is None
    acc.launched.append(SimpleNamespace(read=True, event="end of step 1"))
    acc.launched.append(SimpleNamespace(read=False, event="end of step 2"))
    assert acc._read_upto() == "end of step 1"
    acc.launched[-1].read = True
    assert acc._read_upto() == "end of step 2"
    acc.launched.append(SimpleNamespace(read=False, event="end of step 3"))
    assert len(acc.launched) == 2 and acc._read_upto() == "end of step 2"


def test_warm_up_runs_every_chunk_class_and_leaves_the_pool_clean(tmp_path, monkeypatch):
    """The start-up warm-up runs a chunk of each size class, from position 0 and after a page
    of prefix, then mixed steps over growing contexts (split-K classes), within a pool smaller
    than its longest chunk, and leaves every page as a new pool's (zeros): requests after it
    see what they would without it."""
    from deepinfer.backends.cuda.dummy_batches import (
        SMALL_CHUNKS,
        split_warmup_contexts,
        warmup_batch,
        warmup_token_counts,
    )
    from tests.checkpoints import make_checkpoint

    assert warmup_token_counts(17) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 17]
    assert warmup_token_counts(8192)[-3:] == [4096, 4097, 8192]
    wrapped = warmup_batch(40, 16, 16, num_blocks=3)
    assert wrapped.block_tables == [[1, 2, 1, 2]] and wrapped.positions[0] == 16
    assert min(wrapped.slot_mapping) >= 16 and max(wrapped.slot_mapping) < 48
    path = make_checkpoint(str(tmp_path / "m"), "qwen3_moe", torch.float32)
    acc = _interpreted_cls()()
    acc.init_device()
    acc.max_num_batched_tokens = 17
    acc.load_model(ModelSpec(path, dtype="float32", max_model_len=256))  # split contexts 128, 256
    acc.allocate_kv_cache(2, 16)  # one usable block: every chunk past 16 tokens wraps
    chunks = []
    forward = acc._forward
    monkeypatch.setattr(acc, "_forward", lambda inputs: chunks.append(
        (inputs.positions[0].item(), inputs.positions.numel())) or forward(inputs))
    for _, tensor in acc.cache.chunk_tensors():
        tensor.fill_(1.0)
    acc.warm_up_kernels()
    splits = [step for context in split_warmup_contexts(acc.max_model_len)  # a chunk alone,
              for step in ((context - SMALL_CHUNKS, SMALL_CHUNKS),  # then behind a decode
                           (context - 1, 1 + SMALL_CHUNKS))]
    assert len(splits) >= 2
    assert chunks == [(offset, n) for n in warmup_token_counts(17) for offset in (0, 16)] + splits
    assert all(not tensor.any() for _, tensor in acc.cache.chunk_tensors())
    acc.shutdown()
