"""Conformance suite a backend author runs against their Accelerator.

It drives the backend only through the Accelerator API with hand-built ModelBatch objects (the
way the scheduler would) on a tiny random-weight llama checkpoint, and compares the greedy tokens
with transformers' own `generate` on each prompt alone. Two ways to run it:

    run_conformance(MyAccelerator, workdir)          # raises AssertionError naming the check

    class TestMyBackend(AcceleratorConformance):     # pytest: one test per check
        accelerator_cls = MyAccelerator
"""
from __future__ import annotations

import math
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from deepinfer.core.accelerator import Accelerator, Capabilities
from deepinfer.core.batch import GroupBatch, ModelBatch, SamplingRow
from deepinfer.core.config import CacheConfig, ModelSpec
from deepinfer.core.sampling import SamplingParams

BLOCK_SIZE = 4
MIN_KV_BLOCKS = 32  # the checks below use about 20 blocks
DECODE_STEPS = 8
VOCAB = 128
# Reference paths whose top-1 and top-2 logits are closer than this are rejected (another seed is
# tried), so an honest backend never fails on a float32 rounding tie.
MIN_MARGIN = 1e-3
PROMPT_A_LEN, PROMPT_B_LEN, SHARED_PREFIX_LEN = 7, 10, 8


@dataclass
class Seq:
    """One sequence as a scheduler tracks it: tokens, its block table, tokens already in KV."""

    name: str
    prompt: list[int]
    blocks: list[int]
    outputs: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` new tokens of `seq` in one step; `sample` only when they end its prompt."""

    seq: Seq
    num_tokens: int = 1
    sample: bool = True


class BlockPool:
    """Hands out block ids in a shuffled order, so block tables are never contiguous and block 0
    (the null block) is never used, as with a real block manager after some churn."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, num_tokens: int) -> list[int]:
        count = math.ceil(num_tokens / BLOCK_SIZE)
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def build_batch(chunks: list[Chunk], block_size: int = BLOCK_SIZE) -> ModelBatch:
    input_ids, positions, slots, tables, sample_indices, rows = [], [], [], [], [], []
    for index, chunk in enumerate(chunks):
        seq, start = chunk.seq, chunk.seq.computed
        end = start + chunk.num_tokens
        input_ids += seq.tokens[start:end]
        positions += list(range(start, end))
        slots += [seq.blocks[p // block_size] * block_size + p % block_size
                  for p in range(start, end)]
        tables.append(seq.blocks[:math.ceil(end / block_size)])
        if chunk.sample:
            sample_indices.append(index)
            rows.append(SamplingRow(
                params=SamplingParams(temperature=0.0, max_tokens=64), seed=0,
                step=len(seq.outputs), prompt_token_ids=list(seq.prompt),
                output_token_ids=list(seq.outputs), eos_token_ids=()))
    return ModelBatch(
        input_ids=input_ids, positions=positions,
        query_lens=[c.num_tokens for c in chunks],
        seq_lens=[c.seq.computed + c.num_tokens for c in chunks],
        groups=(GroupBatch(tables, slots),), block_size=block_size,
        sample_indices=sample_indices, sampling=rows)


def run_step(accelerator: Accelerator, chunks: list[Chunk]) -> None:
    """Execute one batch and advance each sequence the way the scheduler would."""
    batch = build_batch(chunks)
    out = accelerator.execute(batch)
    sampled = [c.seq for c in chunks if c.sample]
    assert len(out.token_ids) == len(sampled), (
        f"execute returned {len(out.token_ids)} tokens for {len(sampled)} sampled sequences "
        f"(sample_indices={batch.sample_indices})")
    assert len(out.logprobs) == len(out.token_ids), "SamplerOutput.logprobs must be parallel"
    for chunk in chunks:
        chunk.seq.computed += chunk.num_tokens
    for seq, token in zip(sampled, out.token_ids):
        assert isinstance(token, int) and 0 <= token < VOCAB, f"{seq.name}: bad token {token!r}"
        seq.outputs.append(token)


def decode(accelerator: Accelerator, seqs: list[Seq], until: int = DECODE_STEPS) -> None:
    while any(len(s.outputs) < until for s in seqs):
        run_step(accelerator, [Chunk(s) for s in seqs if len(s.outputs) < until])


class ConformanceSuite:
    """Makes the checkpoint and transformers' reference tokens once; each check then runs on a
    freshly loaded accelerator."""

    def __init__(self, accelerator_cls: type[Accelerator], workdir: str) -> None:
        self.accelerator_cls = accelerator_cls
        self.workdir = workdir
        rng = random.Random(1)
        self.prompts = {"A": [rng.randrange(3, VOCAB) for _ in range(PROMPT_A_LEN)],
                        "B": [rng.randrange(3, VOCAB) for _ in range(PROMPT_B_LEN)]}
        self.prompts["C"] = self.prompts["B"][:SHARED_PREFIX_LEN] + [
            rng.randrange(3, VOCAB) for _ in range(5)]
        self.expected = self._make_checkpoint()

    def _make_checkpoint(self) -> dict[str, list[int]]:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
            dtype="float32", bos_token_id=None, eos_token_id=None, pad_token_id=None)
        for seed in range(32):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config).eval()
            expected, margin = {}, math.inf
            for name, prompt in self.prompts.items():
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                    do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
                expected[name] = out.sequences[0, len(prompt):].tolist()
                top2 = torch.stack(out.scores).topk(2, dim=-1).values
                margin = min(margin, float((top2[..., 0] - top2[..., 1]).min()))
            if margin >= MIN_MARGIN:
                model.save_pretrained(self.workdir)
                return expected
        raise RuntimeError("no seed gave a reference path without near-ties")

    @contextmanager
    def loaded(self) -> Iterator[tuple[Accelerator, BlockPool]]:
        accelerator = self.accelerator_cls()
        accelerator.init_device()
        try:
            accelerator.load_model(ModelSpec(self.workdir, dtype="float32"))
            # A tiny model needs a tiny pool on any backend (a GPU's default fraction would
            # allocate tens of gigabytes per check).
            num_blocks = accelerator.num_kv_blocks(CacheConfig(
                block_size=BLOCK_SIZE, kv_cache_memory_gb=0.01, gpu_memory_utilization=0.05))
            assert isinstance(num_blocks, int) and num_blocks >= MIN_KV_BLOCKS, (
                f"num_kv_blocks gave {num_blocks!r} for 10 MB of a tiny model; "
                f"need an int >= {MIN_KV_BLOCKS}")
            accelerator.allocate_kv_cache(num_blocks, block_size=BLOCK_SIZE)
            yield accelerator, BlockPool(num_blocks)
        finally:
            accelerator.shutdown()

    def new_seq(self, pool: BlockPool, name: str) -> Seq:
        prompt = self.prompts[name]
        return Seq(name, list(prompt), pool.take(len(prompt) + DECODE_STEPS))

    def assert_matches(self, check: str, *seqs: Seq) -> None:
        for seq in seqs:
            want = self.expected[seq.name][:len(seq.outputs)]
            assert seq.outputs == want, (
                f"{check}: prompt {seq.name} {seq.prompt} generated {seq.outputs}, "
                f"transformers greedy generate gives {want}")

    def check_probe(self) -> None:
        available = self.accelerator_cls.is_available()
        assert isinstance(available, bool), f"is_available() returned {available!r}, not a bool"
        caps = self.accelerator_cls().capabilities
        assert isinstance(caps, Capabilities), f"capabilities is {caps!r}, not a Capabilities"

    def check_batched_greedy(self) -> None:
        """Two prompts of different lengths prefilled together, then decoded together."""
        with self.loaded() as (acc, pool):
            a, b = self.new_seq(pool, "A"), self.new_seq(pool, "B")
            run_step(acc, [Chunk(a, len(a.prompt)), Chunk(b, len(b.prompt))])
            decode(acc, [a, b])
            self.assert_matches("batched greedy decode", a, b)

    def check_chunked_prefill(self) -> None:
        """B's prompt in three chunks; partial chunks are not sampled, even beside other work."""
        with self.loaded() as (acc, pool):
            a, b = self.new_seq(pool, "A"), self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, 3, sample=False)])  # a step that samples nothing at all
            run_step(acc, [Chunk(a, len(a.prompt)), Chunk(b, 3, sample=False)])
            run_step(acc, [Chunk(a), Chunk(b, len(b.prompt) - 6)])
            decode(acc, [a, b])
            self.assert_matches("chunked prefill", a, b)

    def check_prefix_reuse(self) -> None:
        """C shares B's first two full blocks: it prefills only its suffix, beside B's decode."""
        with self.loaded() as (acc, pool):
            b = self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, len(b.prompt))])
            shared = b.blocks[:SHARED_PREFIX_LEN // BLOCK_SIZE]
            c_prompt = self.prompts["C"]
            c = Seq("C", list(c_prompt), shared + pool.take(
                len(c_prompt) + DECODE_STEPS - SHARED_PREFIX_LEN), computed=SHARED_PREFIX_LEN)
            run_step(acc, [Chunk(c, len(c_prompt) - SHARED_PREFIX_LEN), Chunk(b)])
            decode(acc, [b, c])
            self.assert_matches("prefix reuse", b, c)

    def check_host_page_copy(self) -> None:
        """host_page_copy: B's shared blocks go to host and back into C's fresh blocks."""
        if not self.accelerator_cls().capabilities.host_page_copy:
            return
        with self.loaded() as (acc, pool):
            b = self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, len(b.prompt))])
            acc.allocate_host_pool(4)
            n = SHARED_PREFIX_LEN // BLOCK_SIZE
            c_prompt = self.prompts["C"]
            c = Seq("C", c_prompt, pool.take(len(c_prompt) + DECODE_STEPS), computed=n * BLOCK_SIZE)
            for blocks, to_device in ((b.blocks[:n], False), (c.blocks[:n], True)):
                handle = acc.copy_pages([3, 1], [blocks], to_device)  # pages out of block order
                if handle is not None:
                    handle.wait()
            run_step(acc, [Chunk(c, len(c_prompt) - SHARED_PREFIX_LEN)])
            decode(acc, [c])
            self.assert_matches("host page copy", c)

    def check_shutdown_idempotent(self) -> None:
        with self.loaded() as (acc, _):
            acc.shutdown()  # the context manager shuts it down a second time

    def checks(self) -> list[tuple[str, Callable[[], None]]]:
        return [("probe and capabilities", self.check_probe),
                ("batched greedy decode", self.check_batched_greedy),
                ("chunked prefill", self.check_chunked_prefill),
                ("prefix reuse", self.check_prefix_reuse),
                ("host page copy", self.check_host_page_copy),
                ("shutdown is idempotent", self.check_shutdown_idempotent)]


def run_conformance(accelerator_cls: type[Accelerator], workdir: str) -> None:
    """Run every check; an AssertionError names the failing check."""
    suite = ConformanceSuite(accelerator_cls, workdir)
    for name, check in suite.checks():
        try:
            check()
        except AssertionError as exc:
            raise AssertionError(f"{accelerator_cls.__name__} failed [{name}]: {exc}") from exc


class AcceleratorConformance:
    """Subclass as `class TestX(AcceleratorConformance): accelerator_cls = X` for one pytest test
    per check. Not named Test*, so pytest collects only the subclasses."""

    accelerator_cls: type[Accelerator]
    suite: ConformanceSuite
    workdir: str

    @classmethod
    def setup_class(cls) -> None:
        cls.workdir = tempfile.mkdtemp(prefix="deepinfer-conformance-")
        cls.suite = ConformanceSuite(cls.accelerator_cls, cls.workdir)

    @classmethod
    def teardown_class(cls) -> None:
        shutil.rmtree(cls.workdir, ignore_errors=True)

    def test_probe_and_capabilities(self) -> None:
        self.suite.check_probe()

    def test_batched_greedy_decode(self) -> None:
        self.suite.check_batched_greedy()

    def test_chunked_prefill(self) -> None:
        self.suite.check_chunked_prefill()

    def test_prefix_reuse(self) -> None:
        self.suite.check_prefix_reuse()

    def test_host_page_copy(self) -> None:
        self.suite.check_host_page_copy()

    def test_shutdown_is_idempotent(self) -> None:
        self.suite.check_shutdown_idempotent()
