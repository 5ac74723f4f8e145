"""Conformance suite a backend author runs against their Accelerator.

It drives the backend only through the Accelerator API with hand-built ModelBatch objects (the
way the scheduler would) and compares the greedy tokens with transformers' own `generate` on
each prompt alone. Every check runs on three tiny random-weight checkpoints, one per *KV shape*
a model can declare in its KV spec (deepinfer.core.kv.spec):

    kv       llama: two cache entries per layer, K and V
    latent   dense DeepSeek-V3: one MLA latent entry per layer
    window   Mistral with a 6-token sliding window: a windowed KV group whose block tables
             hold the null block where the engine freed the blocks that fell out of the window

Two ways to run it:

    run_conformance(MyAccelerator, workdir)          # raises AssertionError naming the check

    class TestMyBackend(AcceleratorConformance):     # pytest: one test per check and shape
        accelerator_cls = MyAccelerator
        kv_shapes = ("kv", "window")                 # optional: shapes it does not run

A backend that does not run a shape fails with a message naming it, unless it opts the shape
out (kv_shapes above; run_conformance(..., shapes=...)).
"""
from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from deepinfer.core.accelerator import Accelerator, Capabilities, ModelInfo
from deepinfer.core.config import CacheConfig, ModelSpec
from deepinfer.core.kv.spec import KVSpec

# Re-exported: a backend's own tests build batches with them (see examples/plugin).
from deepinfer.testing.batches import (  # noqa: F401
    BLOCK_SIZE,
    DECODE_STEPS,
    NULL_BLOCK,
    VOCAB,
    BlockPool,
    Chunk,
    Seq,
    build_batch,
    decode,
    run_step,
)

MIN_KV_BLOCKS = 32  # the checks below use about 20 blocks
# The window shape's sliding window: shorter than every prompt, so prefills and decodes cross
# it and whole blocks fall out of it (BLOCK_SIZE 4; sequences of 7 to 21 tokens).
WINDOW = 6
# Reference paths whose top-1 and top-2 logits are closer than this are rejected (another seed is
# tried), so an honest backend never fails on a float32 rounding tie.
MIN_MARGIN = 1e-3
PROMPT_A_LEN, PROMPT_B_LEN, SHARED_PREFIX_LEN = 7, 10, 8

KV_SHAPES = ("kv", "latent", "window")
SHAPE_DESCRIPTIONS = {
    "kv": "llama, two cache entries per layer (K and V)",
    "latent": "dense DeepSeek-V3, one MLA latent entry per layer",
    "window": f"Mistral, a KV group with a {WINDOW}-token sliding window",
}


# ---- the reference checkpoints -------------------------------------------------------------
def _reference_model(shape: str, seed: int) -> Any:
    """A tiny random-weight transformers model of the shape (float32, no special tokens)."""
    import torch
    import transformers

    # Larger weights than the default init (0.02): attention far from uniform and logits that
    # move, so a subtle error (a position off by one, keys read outside a window) changes the
    # greedy tokens instead of averaging out.
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
                  initializer_range=0.1, dtype="float32", bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if shape == "kv":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
        model_cls = transformers.LlamaForCausalLM
    elif shape == "latent":
        # Every layer dense (first_k_dense_replace = num_hidden_layers): no MoE.
        config = transformers.DeepseekV3Config(
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, **common)
        model_cls = transformers.DeepseekV3ForCausalLM
    elif shape == "window":
        config = transformers.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW,
                                            **common)
        model_cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown KV shape {shape!r}; the shapes are {', '.join(KV_SHAPES)}")
    torch.manual_seed(seed)
    return model_cls(config).eval()


# (shape, prompts) -> (model, expected tokens per prompt). The reference depends on nothing
# else, so a process running the suite several times (several backends, broken ones in the
# suite's own tests) searches seeds and runs transformers' generate once per shape.
_REFERENCES: dict[tuple[str, tuple[tuple[int, ...], ...]], tuple[Any, dict[str, list[int]]]] = {}


def _reference(shape: str, prompts: dict[str, list[int]]) -> tuple[Any, dict[str, list[int]]]:
    import torch

    key = (shape, tuple(tuple(p) for p in prompts.values()))
    if key in _REFERENCES:
        return _REFERENCES[key]
    for seed in range(32):
        model = _reference_model(shape, seed)
        expected, margin = {}, math.inf
        with torch.no_grad():
            for name, prompt in prompts.items():
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                    min_new_tokens=DECODE_STEPS, do_sample=False, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)
                expected[name] = out.sequences[0, len(prompt):].tolist()
                top2 = torch.stack(out.logits).float().topk(2, dim=-1).values
                margin = min(margin, float((top2[..., 0] - top2[..., 1]).min()))
        if margin >= MIN_MARGIN:
            _REFERENCES[key] = model, expected
            return model, expected
    raise RuntimeError(f"{shape}: no seed gave a reference path without near-ties")


class ConformanceSuite:
    """Makes each shape's checkpoint and transformers' reference tokens once, when a check of
    that shape first needs them; each check then runs on a freshly loaded accelerator."""

    CHECKS = {"batched greedy decode": "check_batched_greedy",
              "chunked prefill": "check_chunked_prefill",
              "prefix reuse": "check_prefix_reuse",
              "host page copy": "check_host_page_copy",
              "shutdown is idempotent": "check_shutdown_idempotent"}

    def __init__(self, accelerator_cls: type[Accelerator], workdir: str,
                 shapes: Sequence[str] = KV_SHAPES) -> None:
        unknown = [s for s in shapes if s not in KV_SHAPES]
        if unknown:
            raise ValueError(f"unknown KV shapes {unknown}; the shapes are {', '.join(KV_SHAPES)}")
        self.accelerator_cls = accelerator_cls
        self.workdir = workdir
        self.shapes = tuple(shapes)
        rng = random.Random(1)
        self.prompts = {"A": [rng.randrange(3, VOCAB) for _ in range(PROMPT_A_LEN)],
                        "B": [rng.randrange(3, VOCAB) for _ in range(PROMPT_B_LEN)]}
        self.prompts["C"] = self.prompts["B"][:SHARED_PREFIX_LEN] + [
            rng.randrange(3, VOCAB) for _ in range(5)]
        self.expected: dict[str, dict[str, list[int]]] = {}  # shape -> prompt -> tokens

    def checkpoint(self, shape: str) -> str:
        """The folder of the shape's checkpoint, written on first use."""
        path = os.path.join(self.workdir, shape)
        if shape not in self.expected:
            model, expected = _reference(shape, self.prompts)
            model.save_pretrained(path)
            self.expected[shape] = expected
        return path

    def _shape(self, shape: str | None) -> str:
        return self.shapes[0] if shape is None else shape

    @contextmanager
    def loaded(self, shape: str | None = None) -> Iterator[tuple[Accelerator, BlockPool]]:
        """A fresh accelerator with the shape's checkpoint (default: the suite's first shape)
        loaded and a KV pool allocated, and a BlockPool whose sequences follow its KV spec."""
        shape = self._shape(shape)
        path = self.checkpoint(shape)
        accelerator = self.accelerator_cls()
        accelerator.init_device()
        try:
            info = accelerator.load_model(ModelSpec(path, dtype="float32"))
            spec = _check_model_info(info)
            # A tiny model needs a tiny pool on any backend (a GPU's default fraction would
            # allocate tens of gigabytes per check).
            num_blocks = accelerator.num_kv_blocks(CacheConfig(
                block_size=BLOCK_SIZE, kv_cache_memory_gb=0.01, gpu_memory_utilization=0.05))
            assert isinstance(num_blocks, int) and num_blocks >= MIN_KV_BLOCKS, (
                f"num_kv_blocks gave {num_blocks!r} for 10 MB of a tiny model; "
                f"need an int >= {MIN_KV_BLOCKS}")
            accelerator.allocate_kv_cache(num_blocks, block_size=BLOCK_SIZE)
            accelerator.warm_up()  # the engine's start-up steps, in its order
            accelerator.capture_graphs()
            # The engine builds its block tables from the KV spec the backend reports.
            windows = tuple(g.sliding_window for g in spec.groups)
            yield accelerator, BlockPool(num_blocks, windows=windows)
        finally:
            accelerator.shutdown()

    def new_seq(self, pool: BlockPool, name: str) -> Seq:
        prompt = self.prompts[name]
        return Seq(name, list(prompt), pool.take(len(prompt) + DECODE_STEPS),
                   windows=pool.windows)

    def assert_matches(self, check: str, shape: str, *seqs: Seq) -> None:
        for seq in seqs:
            want = self.expected[shape][seq.name][:len(seq.outputs)]
            assert seq.outputs == want, (
                f"{check}: prompt {seq.name} {seq.prompt} generated {seq.outputs}, "
                f"transformers greedy generate gives {want}")

    # ---- the checks ------------------------------------------------------------------------
    def check_probe(self) -> None:
        available = self.accelerator_cls.is_available()
        assert isinstance(available, bool), f"is_available() returned {available!r}, not a bool"
        caps = self.accelerator_cls().capabilities
        assert isinstance(caps, Capabilities), f"capabilities is {caps!r}, not a Capabilities"

    def check_batched_greedy(self, shape: str | None = None) -> None:
        """Two prompts of different lengths prefilled together, then decoded together."""
        shape = self._shape(shape)
        with self.loaded(shape) as (acc, pool):
            a, b = self.new_seq(pool, "A"), self.new_seq(pool, "B")
            run_step(acc, [Chunk(a, len(a.prompt)), Chunk(b, len(b.prompt))])
            decode(acc, [a, b])
            self.assert_matches("batched greedy decode", shape, a, b)

    def check_chunked_prefill(self, shape: str | None = None) -> None:
        """B's prompt in three chunks; partial chunks are not sampled, even beside other work."""
        shape = self._shape(shape)
        with self.loaded(shape) as (acc, pool):
            a, b = self.new_seq(pool, "A"), self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, 3, sample=False)])  # a step that samples nothing at all
            run_step(acc, [Chunk(a, len(a.prompt)), Chunk(b, 3, sample=False)])
            run_step(acc, [Chunk(a), Chunk(b, len(b.prompt) - 6)])
            decode(acc, [a, b])
            self.assert_matches("chunked prefill", shape, a, b)

    def check_prefix_reuse(self, shape: str | None = None) -> None:
        """C shares B's first two full blocks: it prefills only its suffix, beside B's decode."""
        shape = self._shape(shape)
        with self.loaded(shape) as (acc, pool):
            b = self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, len(b.prompt))])
            shared = b.blocks[:SHARED_PREFIX_LEN // BLOCK_SIZE]
            c_prompt = self.prompts["C"]
            c = Seq("C", list(c_prompt), shared + pool.take(
                len(c_prompt) + DECODE_STEPS - SHARED_PREFIX_LEN), computed=SHARED_PREFIX_LEN,
                windows=pool.windows)
            run_step(acc, [Chunk(c, len(c_prompt) - SHARED_PREFIX_LEN), Chunk(b)])
            decode(acc, [b, c])
            self.assert_matches("prefix reuse", shape, b, c)

    def check_host_page_copy(self, shape: str | None = None) -> None:
        """host_page_copy: B's shared blocks go to host and back into C's fresh blocks, in
        every KV group."""
        shape = self._shape(shape)
        if not self.accelerator_cls().capabilities.host_page_copy:
            return
        with self.loaded(shape) as (acc, pool):
            b = self.new_seq(pool, "B")
            run_step(acc, [Chunk(b, len(b.prompt))])
            acc.allocate_host_pool(4)
            n = SHARED_PREFIX_LEN // BLOCK_SIZE
            c_prompt = self.prompts["C"]
            c = Seq("C", list(c_prompt), pool.take(len(c_prompt) + DECODE_STEPS),
                    computed=n * BLOCK_SIZE, windows=pool.windows)
            for blocks, to_device in ((b.blocks[:n], False), (c.blocks[:n], True)):
                # pages out of block order; one list of blocks per KV group
                handle = acc.copy_pages([3, 1], [blocks] * len(pool.windows), to_device)
                if handle is not None:
                    handle.wait()
            run_step(acc, [Chunk(c, len(c_prompt) - SHARED_PREFIX_LEN)])
            decode(acc, [c])
            self.assert_matches("host page copy", shape, c)

    def check_shutdown_idempotent(self, shape: str | None = None) -> None:
        with self.loaded(shape) as (acc, _):
            acc.shutdown()  # the context manager shuts it down a second time

    def run(self, check: str, shape: str | None = None) -> None:
        """Run one check ("probe and capabilities", or a name of CHECKS on a shape). Any
        failure is an AssertionError naming the backend, the shape and the check; an error
        that is not an assertion (an op the backend lacks, an architecture it refuses) says
        how to opt the shape out."""
        backend = self.accelerator_cls.__name__
        if check == "probe and capabilities":
            try:
                self.check_probe()
            except AssertionError as exc:
                raise AssertionError(f"{backend} failed [{check}]: {exc}") from exc
            return
        shape = self._shape(shape)
        where = f"{backend} failed [{shape}: {check}] ({SHAPE_DESCRIPTIONS[shape]})"
        try:
            getattr(self, self.CHECKS[check])(shape)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        except Exception as exc:
            others = tuple(s for s in self.shapes if s != shape)
            raise AssertionError(
                f"{where}: {type(exc).__name__}: {exc}. A backend that does not run the "
                f"{shape!r} KV shape opts it out: kv_shapes = {others} on its "
                f"AcceleratorConformance subclass, or run_conformance(..., shapes={others})"
            ) from exc

    def checks(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, check) pairs: the probe, then every check on each of the suite's shapes."""
        out: list[tuple[str, Callable[[], None]]] = [
            ("probe and capabilities", lambda: self.run("probe and capabilities"))]
        for shape in self.shapes:
            for check in self.CHECKS:
                out.append((f"{shape}: {check}",
                            lambda check=check, shape=shape: self.run(check, shape)))
        return out


def _check_model_info(info: Any) -> KVSpec:
    assert isinstance(info, ModelInfo), f"load_model returned {info!r}, not a ModelInfo"
    assert info.vocab_size == VOCAB, f"ModelInfo.vocab_size is {info.vocab_size}, not {VOCAB}"
    longest = SHARED_PREFIX_LEN + 5 + DECODE_STEPS
    assert info.max_model_len >= longest, (
        f"ModelInfo.max_model_len is {info.max_model_len}; the checks need {longest}")
    spec = info.kv_spec
    assert isinstance(spec, KVSpec) and spec.num_groups >= 1, (
        f"ModelInfo.kv_spec is {spec!r}, not a KVSpec with at least one KV group")
    return spec


def run_conformance(accelerator_cls: type[Accelerator], workdir: str,
                    shapes: Sequence[str] = KV_SHAPES) -> None:
    """Run every check on every shape in `shapes`; an AssertionError names the failing check
    as "[shape: check]"."""
    for _, check in ConformanceSuite(accelerator_cls, workdir, shapes).checks():
        check()


class AcceleratorConformance:
    """Subclass as `class TestX(AcceleratorConformance): accelerator_cls = X` for one pytest test
    per check and KV shape (test ids end in [kv], [latent], [window]). A shape left out of
    `kv_shapes` is reported as skipped. Not named Test*, so pytest collects only the
    subclasses."""

    accelerator_cls: type[Accelerator]
    kv_shapes: tuple[str, ...] = KV_SHAPES
    suite: ConformanceSuite
    workdir: str

    def pytest_generate_tests(self, metafunc: Any) -> None:
        # pytest calls a test class's own pytest_generate_tests for each of its methods.
        if "kv_shape" not in metafunc.fixturenames:
            return
        import pytest

        params = [pytest.param(shape, id=shape, marks=() if shape in self.kv_shapes else
                               pytest.mark.skip(reason=f"{shape} opted out (kv_shapes)"))
                  for shape in KV_SHAPES]
        metafunc.parametrize("kv_shape", params)

    @classmethod
    def setup_class(cls) -> None:
        cls.workdir = tempfile.mkdtemp(prefix="deepinfer-conformance-")
        cls.suite = ConformanceSuite(cls.accelerator_cls, cls.workdir, cls.kv_shapes)

    @classmethod
    def teardown_class(cls) -> None:
        shutil.rmtree(cls.workdir, ignore_errors=True)

    def test_probe_and_capabilities(self) -> None:
        self.suite.run("probe and capabilities")

    def test_batched_greedy_decode(self, kv_shape: str) -> None:
        self.suite.run("batched greedy decode", kv_shape)

    def test_chunked_prefill(self, kv_shape: str) -> None:
        self.suite.run("chunked prefill", kv_shape)

    def test_prefix_reuse(self, kv_shape: str) -> None:
        self.suite.run("prefix reuse", kv_shape)

    def test_host_page_copy(self, kv_shape: str) -> None:
        self.suite.run("host page copy", kv_shape)

    def test_shutdown_is_idempotent(self, kv_shape: str) -> None:
        self.suite.run("shutdown is idempotent", kv_shape)
