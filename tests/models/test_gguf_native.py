"""GGUF blocks served as stored on the CPU backend (models/quant, backends/cpu/kernels.py):
the C++ kernels against gguf-py's dequantization, a tiny converted GGUF loaded packed against
its own dequantized float32 path and transformers, the embedded default model's greedy answer
against its float32 path, and the fused float32 ops against the torch references."""
from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from transformers import AutoModelForCausalLM

from deepinfer.backends.cpu import kernels
from deepinfer.backends.cpu.kernels import CHUNKED_GEMV_ROWS, MAX_GEMV_ROWS, extension, gguf_linear
from deepinfer.backends.torch import ops as reference_ops
from deepinfer.backends.torch.paged_cache import zeros
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from deepinfer.models.gguf_convert import convert_gguf
from deepinfer.models.quant.packed import GGUFParts, GGUFWeight
from deepinfer.models.quant.tensors import GGUFTensor
from tests.models.test_gguf_convert import TEXT, tiny_model, tokenizer, write_gguf  # noqa: F401

TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
         GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0)


def _blocks(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> GGUFTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return GGUFTensor(torch.from_numpy(quantize(w, qtype)), int(qtype), (n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [96, 160, 576, 1536])  # tails of 3, 1, 2 and 0 blocks
def test_kernels_equal_the_dequantized_weight(qtype, k):
    w = _blocks(40, k, qtype)
    reference = w.dequantize()
    assert torch.equal(extension().dequantize(w.blocks, w.qtype, k), reference)
    # the GEMV at batch 1, several rows, in even chunks (17 rows: 9 + 8, no row alone with
    # batch 1's int16 rounding), then the GEMM
    for m in (1, 5, MAX_GEMV_ROWS + 1, MAX_GEMV_ROWS + 4, CHUNKED_GEMV_ROWS + 4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = gguf_linear(x, w.blocks, w.qtype, k)
        torch.testing.assert_close(y, _expected(x, w, reference), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(y, x @ reference.T, rtol=1e-4, atol=2e-3)


def _expected(x: torch.Tensor, w: GGUFTensor, reference: torch.Tensor,
              int16_rows: int = 1) -> torch.Tensor:
    """What the kernels compute: up to int16_rows rows (the file layout's GEMV: 1; with rows
    interleaved: MAX_GEMV_ROWS), x rounded to int16 per 32-column block times the block's
    centred values, and x as it is times Q4_1's offset; more rows multiply x as it is (the
    dequantized weight's products in float32, summation order only). Up to CHUNKED_GEMV_ROWS
    rows the GEMV takes them in even chunks of at most MAX_GEMV_ROWS."""
    if MAX_GEMV_ROWS < x.shape[0] <= CHUNKED_GEMV_ROWS:
        chunks = x.tensor_split(-(-x.shape[0] // MAX_GEMV_ROWS))
        return torch.cat([_expected(c, w, reference, int16_rows) for c in chunks])
    if x.shape[0] > int16_rows:
        return x @ reference.T
    x16 = _int16_blocks(x)
    if w.qtype == GGMLQuantizationType.Q4_K:  # w = d*sc*q - dmin*m
        return x16 @ reference.T - (x - x16) @ _k_quant_minimums(w).T
    return x16 @ reference.T + (x - x16) @ _q4_1_offsets(w).T


@pytest.mark.parametrize("qtype", kernels.INTERLEAVED_TYPES,
                         ids=lambda t: GGMLQuantizationType(t).name)
@pytest.mark.parametrize("k", [96, 576, 1536])
def test_interleaved_rows_compute_what_the_file_layout_does(qtype, k):
    """Rows interleaved by 8 (gguf_rows8.cpp): the weight's bytes reorder in place and back,
    dequantize and embedding lookups read them as the file's, and the kernels compute what
    the file layout's batch-1 GEMV does (the same integers, float rounding of the scales
    apart) for every row up to MAX_GEMV_ROWS; the GEMM's dequantization restores groups.
    Q4_K's super-blocks take K = 512 and 1536."""
    if qtype == GGMLQuantizationType.Q4_K:
        k = 512 if k == 96 else 1536 if k == 576 else 256
        w = _k_quant_blocks(48, k, GGMLQuantizationType.Q4_K, seed=k, scale=0.002)
    else:
        w = _blocks(48, k, GGMLQuantizationType(qtype))
    packed = GGUFWeight(w.shape, qtype)
    packed.load_rows(w, None)
    packed.interleave_rows(kernels.INTERLEAVE)
    assert not torch.equal(packed.blocks, w.blocks)
    assert torch.equal(packed.file_blocks(), w.blocks)
    reference = w.dequantize()
    assert torch.equal(packed.dequantize(), reference)
    ids = torch.tensor([47, 3, 8, 3, 0])
    assert torch.equal(packed.lookup(ids), reference[ids])
    assert torch.equal(extension().dequantize(packed.blocks, qtype, k, True), reference)
    # 4 rows a pass, a tail, two chunks of the GEMV, the GEMM
    for m in (1, 3, 5, MAX_GEMV_ROWS, MAX_GEMV_ROWS + 4, CHUNKED_GEMV_ROWS + 4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = gguf_linear(x, packed.blocks, qtype, k, interleaved=True)
        expected = _expected(x, w, reference, int16_rows=MAX_GEMV_ROWS)
        torch.testing.assert_close(y, expected, rtol=5e-5, atol=3e-4)  # float32 sum orders
        if m == 1:
            file_y = gguf_linear(x, w.blocks, qtype, k)
            torch.testing.assert_close(y, file_y, rtol=2e-6, atol=1e-5)
        # each row as it would be alone: the same bits at any batch
        assert torch.equal(y[-1:], gguf_linear(x[-1:], packed.blocks, qtype, k,
                                               interleaved=True)) or m > CHUNKED_GEMV_ROWS
    packed.load_rows(w.rows(0, 8), (8, 16))  # loading rows goes back to the file's layout
    assert packed.interleaved == 0
    assert torch.equal(packed.blocks[8:16], w.blocks[:8])


def _k_quant_blocks(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0,
                    scale: float = 0.02) -> GGUFTensor:
    """Random k-quant super-blocks (gguf-py has no k-quant quantizer): random quants, scales
    and mins, with fp16 super-block scales up to `scale`."""
    rng = np.random.default_rng(seed)
    nbytes, scale_at = {GGMLQuantizationType.Q2_K: (84, 80), GGMLQuantizationType.Q3_K: (110, 108),
                        GGMLQuantizationType.Q4_K: (144, 0), GGMLQuantizationType.Q5_K: (176, 0),
                        GGMLQuantizationType.Q6_K: (210, 208)}[qtype]
    blocks = rng.integers(0, 256, (n, k // 256, nbytes), dtype=np.uint8)
    scales = rng.uniform(scale / 20, scale, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    with_min = qtype not in (GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q6_K)
    width = 4 if with_min else 2  # d and dmin, or d
    blocks[..., scale_at:scale_at + width] = scales.reshape(n, k // 256, 4)[..., :width]
    return GGUFTensor(torch.from_numpy(blocks.reshape(n, -1)), int(qtype), (n, k))


K_QUANTS = [GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
            GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_kernels_equal_gguf_py(qtype):
    """The k-quants (Q4_K_M and Q5_K_M files: Q4_K, Q5_K, Q6_K; Q2_K and Q3_K_S/M/L files: Q2_K
    and Q3_K too): the kernels' dequantization is gguf-py's (up to a fused multiply-add), and
    the GEMV, at 1 and several rows, multiplies x by it."""
    w = _k_quant_blocks(24, 512, qtype)
    reference = w.dequantize()
    torch.testing.assert_close(extension().dequantize(w.blocks, w.qtype, 512), reference,
                               rtol=1e-6, atol=1e-6)
    for m in (1, 5, MAX_GEMV_ROWS + 4, CHUNKED_GEMV_ROWS + 4):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        expected = x @ reference.T
        if m == 1 and qtype != GGMLQuantizationType.Q2_K:
            # Batch 1 as Q4_1's: x rounded to int16 per 32 columns times the values (Q3_K's
            # and Q6_K's are centred), and x as it is times each Q4_K / Q5_K sub-block's
            # minimum.
            x16 = _int16_blocks(x)
            expected = x16 @ reference.T
            if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
                expected = expected - (x - x16) @ _k_quant_minimums(w).T
        torch.testing.assert_close(gguf_linear(x, w.blocks, w.qtype, 512), expected,
                                   rtol=5e-5, atol=3e-4)  # float32 sum orders


@pytest.mark.parametrize("qtype", TYPES + tuple(K_QUANTS), ids=lambda t: t.name)
def test_bf16_dequantization_rounds_the_float32_one(qtype):
    """A GEMM in bfloat16 takes the weight expanded straight to bfloat16 (chunks of 64 rows,
    each thread's float32 buffer rounded to nearest even): bit for bit torch's rounding of the
    float32 weight, in the file's layout and with rows interleaved, 136 rows (a short last
    chunk); gguf_linear with bf16 multiplies x rounded to bfloat16 by it."""
    k = 512
    if qtype in K_QUANTS:
        w = _k_quant_blocks(136, k, qtype, seed=3)
    else:
        w = _blocks(136, k, qtype, seed=3)
    reference = extension().dequantize(w.blocks, w.qtype, k).bfloat16()
    assert torch.equal(extension().dequantize_bf16(w.blocks, w.qtype, k), reference)
    if int(qtype) in kernels.INTERLEAVED_TYPES:
        packed = GGUFWeight(w.shape, int(qtype))
        packed.load_rows(w, None)
        packed.interleave_rows(kernels.INTERLEAVE)
        assert torch.equal(extension().dequantize_bf16(packed.blocks, w.qtype, k, True),
                           reference)
    x = torch.randn(CHUNKED_GEMV_ROWS + 4, k, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x.bfloat16(), reference).float()
    assert torch.equal(gguf_linear(x, w.blocks, w.qtype, k, bf16=True), expected)


def _k_quant_minimums(w: GGUFTensor) -> torch.Tensor:
    """[N, K]: each Q4_K / Q5_K sub-block's dmin * m at its 32 columns (ggml's
    get_scale_min_k4)."""
    n, k = w.shape
    blocks = w.blocks.numpy().reshape(n, k // 256, -1)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 4:16].astype(np.int32)
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)],
                          axis=-1)
    minimums = (dmin[..., None] * mins).astype(np.float32).reshape(n, -1)
    return torch.from_numpy(np.repeat(minimums, 32, axis=1))


def _int16_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the batch-1 GEMV sees it: per 32 columns, scale * round(x / scale) with
    scale = max|x| / 32767."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(blocks / scale) * scale).view_as(x)


def _q4_1_offsets(w: GGUFTensor) -> torch.Tensor:
    """[N, K]: each Q4_1 (Q5_1) block's m + 8d (m + 16d; w = d * (q - centre) + m + centre * d)
    at its 32 columns; zeros for the types whose values are centred already."""
    n, k = w.shape
    centre = {GGMLQuantizationType.Q4_1: 8, GGMLQuantizationType.Q5_1: 16}.get(w.qtype)
    if centre is None:
        return torch.zeros(n, k)
    blocks = w.blocks.numpy().reshape(n, k // 32, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return torch.from_numpy(np.repeat(m + centre * d, 32, axis=1))


def test_tiny_gguf_is_served_packed(tmp_path, tokenizer):  # noqa: F811
    original = tiny_model("llama", tokenizer.get_vocab_size(), tied=True)
    write_gguf(tmp_path / "tiny.gguf", original, tokenizer, GGMLQuantizationType.Q4_1)
    folder = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), progress=False)
    ids = tokenizer.encode(TEXT).ids[:12]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    packed = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16)
    weights = [m for m in packed.engine.accelerator.runner.model.modules()
               if isinstance(m, GGUFWeight)]
    # q|k|v, o, gate|up, down per layer, and the tied embedding / LM head.
    assert len(weights) == 4 * 2 + 1 and {w.kind for w in weights} == {"gguf:Q4_1"}
    ours = packed.generate([ids], params)[0].outputs[0].token_ids
    floats = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16,
                 quantization="none")
    assert not any(isinstance(m, GGUFWeight)
                   for m in floats.engine.accelerator.runner.model.modules())
    # transformers on the dequantized folder, teacher-forced over our tokens.
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]
    assert logits.argmax(-1).tolist() == ours
    # The float32 path is the dequantized weights as they are: transformers' tokens.
    plain = floats.generate([ids], params)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([ids + plain])).logits[0, len(ids) - 1:-1]
    assert logits.argmax(-1).tolist() == plain


def test_decode_plan_is_the_layers_one_by_one(tmp_path, tokenizer, monkeypatch):  # noqa: F811
    """A decode step of a llama stack runs as one C++ call (decode_plan.py), alone and with
    two sequences: greedy tokens and their logprobs equal the layer-by-layer path's to the
    bit, for Q4_1 and Q5_0 weights (rows interleaved), the same model dequantized to float32
    (at::linear and the reference gated MLP in C++), a Qwen2 (q|k|v biases), and a Q4_K_M-style
    file (q|k|v of two block types: GGUFParts)."""
    from deepinfer.backends.cpu import decode_plan

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    cases = []
    for arch, qtype, quantization in (("llama", GGMLQuantizationType.Q4_1, "auto"),
                                      ("llama", GGMLQuantizationType.Q5_0, "auto"),
                                      ("llama", GGMLQuantizationType.Q5_0, "none"),
                                      ("qwen2", GGMLQuantizationType.Q4_1, "auto")):
        original = tiny_model(arch, tokenizer.get_vocab_size(), tied=True)
        name = f"{arch}-{qtype.name}"
        write_gguf(tmp_path / f"{name}.gguf", original, tokenizer, qtype)
        cases.append((convert_gguf(str(tmp_path / f"{name}.gguf"),
                                   str(tmp_path / f"{name}-{quantization}"), progress=False),
                      quantization))
    cases.append((_k_quant_m_gguf(tmp_path, tokenizer, "k-quant-m"), "auto"))
    for folder, quantization in cases:
        ids = [tokenizer.encode(TEXT).ids[:12], tokenizer.encode(TEXT).ids[3:9]]
        runs = []
        for plans in (True, False):
            if not plans:
                monkeypatch.setattr(decode_plan, "build", lambda *args: None)
            llm = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16,
                      quantization=quantization)
            outs = [llm.generate([prompt], params)[0].outputs[0] for prompt in ids]
            outs += [r.outputs[0] for r in llm.generate(ids, params)]  # decoded together
            runs.append([(o.token_ids, o.logprobs) for o in outs])
            built = list(llm.engine.accelerator.runner.ops._plans.values())
            assert [p[0] is not None for p in built] == [plans]
            llm.engine.shutdown()
        monkeypatch.undo()
        assert runs[0] == runs[1]


def test_packed_gguf_with_the_host_tier(tmp_path, tokenizer):  # noqa: F811
    """Packed weights change nothing about the KV caches: a multi-turn conversation whose
    device pages are evicted between turns decodes the same greedy tokens with HiCache on and
    off on a Q4_1 GGUF kept packed, with hits served from the host (testing/hicache.py)."""
    from deepinfer.backends.cpu.accelerator import CPUAccelerator
    from deepinfer.testing.hicache import check_host_tier, make_engine

    original = tiny_model("llama", tokenizer.get_vocab_size(), tied=True)
    write_gguf(tmp_path / "tiny.gguf", original, tokenizer, GGMLQuantizationType.Q4_1)
    folder = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), progress=False)
    engine = make_engine(folder, CPUAccelerator(), host_pages=4)
    assert any(isinstance(m, GGUFWeight) for m in engine.accelerator.runner.model.modules())
    engine.shutdown()
    stats = check_host_tier(folder, CPUAccelerator, vocab=tokenizer.get_vocab_size())
    assert stats.stored_pages > 0


def _q4_k_centred(n: int, k: int, seed: int, d: float) -> np.ndarray:
    """Q4_K super-blocks whose values centre on 0 (random bytes would all lean positive, and
    a model of them answers one token whatever it is asked): sub-block scales 1..8, each min
    7.5 times its scale, dmin = d; the 6-bit pairs packed into the 12 bytes as ggml does."""
    rng = np.random.default_rng(seed)
    sb = k // 256
    sc = rng.integers(1, 9, (n, sb, 8)).astype(np.uint8)
    m = np.round(7.5 * sc).astype(np.uint8)
    packed = np.zeros((n, sb, 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    halves = np.full((n, sb, 2), d, np.float16).view(np.uint8).reshape(n, sb, 4)
    quants = rng.integers(0, 256, (n, sb, 128), dtype=np.uint8)
    return np.concatenate([halves, packed, quants], axis=-1).reshape(n, -1)


def _k_quant_m_gguf(tmp_path, tokenizer, name: str = "tiny",  # noqa: F811
                    main: GGMLQuantizationType = GGMLQuantizationType.Q4_K) -> str:
    """A converted Q4_K_M-style folder: Q4_K (or `main`: Q3_K for a Q3_K_M-style one), its down
    and v projections Q6_K (so each fused q|k|v holds two block types, as in llama.cpp's
    Q4_K_M files)."""
    original = tiny_model("llama", tokenizer.get_vocab_size(), tied=True, hidden_size=256,
                          intermediate_size=512, head_dim=64)
    names = iter(range(1000))

    def encode(name: str, data: np.ndarray):
        if "down_proj" in name or "v_proj" in name:
            q6 = _k_quant_blocks(*data.shape, GGMLQuantizationType.Q6_K, next(names), 0.0005)
            return q6.blocks.numpy(), GGMLQuantizationType.Q6_K
        if main == GGMLQuantizationType.Q3_K:  # its values and scales centre on 0 already
            q3 = _k_quant_blocks(*data.shape, main, next(names), 0.006)
            return q3.blocks.numpy(), main
        return _q4_k_centred(*data.shape, next(names), 0.003), GGMLQuantizationType.Q4_K

    write_gguf(tmp_path / f"{name}.gguf", original, tokenizer, encode=encode)
    return convert_gguf(str(tmp_path / f"{name}.gguf"), str(tmp_path / name), progress=False)


def test_k_quant_gguf_is_served_packed(tmp_path, tokenizer):  # noqa: F811
    """A Q4_K_M-style file keeps its super-blocks packed, its fused q|k|v as row ranges of
    each type (GGUFParts), and answers as its dequantized float32 path and transformers on
    that folder."""
    folder = _k_quant_m_gguf(tmp_path, tokenizer)
    ids = tokenizer.encode(TEXT).ids[:12]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    packed = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16)
    modules = list(packed.engine.accelerator.runner.model.modules())
    kinds = [m.kind for m in modules if isinstance(m, GGUFWeight)]
    # Per layer: q|k and v of q|k|v, o, gate|up, down; and the tied embedding.
    assert sorted(kinds) == ["gguf:Q4_K"] * 7 + ["gguf:Q6_K"] * 4
    q, kv = 4 * 64, 2 * 64  # the tiny model's q rows and k (or v) rows
    assert [m.kind for m in modules if isinstance(m, GGUFParts)] == \
        [f"gguf:Q4_K[0:{q + kv}]+Q6_K[{q + kv}:{q + 2 * kv}]"] * 2
    ours = packed.generate([ids], params)[0].outputs[0].token_ids
    floats = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16,
                 quantization="none")
    assert floats.generate([ids], params)[0].outputs[0].token_ids == ours
    assert len(set(ours)) > 4  # a model that answers, not one token over and over
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]
    assert logits.argmax(-1).tolist() == ours


def test_q3_k_gguf_is_served_packed(tmp_path, tokenizer):  # noqa: F811
    """A Q3_K_M-style file (Q3_K, with Q6_K) keeps its Q3_K super-blocks packed and answers as
    its dequantized float32 path and transformers on that folder."""
    folder = _k_quant_m_gguf(tmp_path, tokenizer, main=GGMLQuantizationType.Q3_K)
    ids = tokenizer.encode(TEXT).ids[:12]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    packed = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16)
    kinds = [m.kind for m in packed.engine.accelerator.runner.model.modules()
             if isinstance(m, GGUFWeight)]
    assert sorted(kinds) == ["gguf:Q3_K"] * 7 + ["gguf:Q6_K"] * 4
    ours = packed.generate([ids], params)[0].outputs[0].token_ids
    floats = LLM(folder, accelerator="cpu", kv_cache_memory_gb=0.05, block_size=16,
                 quantization="none")
    assert floats.generate([ids], params)[0].outputs[0].token_ids == ours
    assert len(set(ours)) > 4
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]
    assert logits.argmax(-1).tolist() == ours


def test_default_model_packed_answers_as_float32():
    """The embedded default: 128 greedy tokens from its Q4_1 blocks equal its dequantized
    float32 path's. (Its first token here is a near-tie, 0.08 nats: llama.cpp's int8
    activations flip it; benchmarks/cpu_gguf.py compares with llama.cpp.)"""
    from deepinfer.models.default_model import ensure_default_model

    folder = ensure_default_model(progress=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    answers = []
    for quantization in ("auto", "none"):
        llm = LLM(folder, quantization=quantization, accelerator="cpu")
        answers.append(llm.chat(messages, params)[0].outputs[0])
        llm.engine.shutdown()
    assert answers[0].token_ids == answers[1].token_ids
    assert "Paris" in answers[0].text


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gguf_mlp_is_its_three_calls(rows, interleaved):
    """One call for a decode step's gated MLP: the same ops in the same order as gemv, silu
    times up, gemv (to the bit), on a Q4_1 gate|up and a Q8_0 down, in the file's layout or
    with their rows interleaved."""
    weights = []
    for n, k, qtype, seed in ((128, 96, GGMLQuantizationType.Q4_1, 0),
                              (96, 64, GGMLQuantizationType.Q8_0, 1)):
        weights.append(GGUFWeight((n, k), qtype))
        weights[-1].load_rows(_blocks(n, k, qtype, seed), None)
        weights[-1].interleave_rows(kernels.INTERLEAVE if interleaved else 0)
    gate_up, down = weights
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    h = gguf_linear(x, gate_up.blocks, gate_up.qtype, 96, interleaved=interleaved)
    expected = gguf_linear(F.silu(h[:, :64]) * h[:, 64:], down.blocks, down.qtype, 64,
                           interleaved=interleaved)
    got = extension().gguf_mlp(x, gate_up.blocks, gate_up.qtype, interleaved, down.blocks,
                               down.qtype, interleaved)
    assert torch.equal(got, expected)


def test_fused_ops_equal_the_torch_references():
    kernels, g = extension(), torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(3, 96, generator=g) for _ in range(3))
    w = w[0]
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference_ops.rms_norm(x, w, 1e-6))
    normed, summed = kernels.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(normed, reference_ops.rms_norm(x + r, w, 1e-6))
    assert torch.equal(summed, x + r)
    # Partial rotary (the first 32 of 64 dims), two positions.
    q, k = torch.randn(2, 6, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    cos, sin = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    pos = torch.tensor([3, 41])
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    expected = reference_ops.apply_rotary(q, c, s), reference_ops.apply_rotary(k, c, s)
    kernels.rotary(q, k, pos, cos, sin)
    torch.testing.assert_close((q, k), expected)
    # Decode attention: GQA (6 query heads over 2 KV heads), sequences of 4 and 9 keys.
    k_cache, v_cache = torch.randn(64, 2, 32, generator=g), torch.randn(64, 2, 32, generator=g)
    slots = torch.tensor([[9, 2, 40, 7, 0, 0, 0, 0, 0], [1, 3, 5, 8, 13, 21, 34, 55, 60]])
    lens, q = torch.tensor([4, 9]), torch.randn(2, 6, 32, generator=g)
    # The step's k/v (strided rows of a fused qkv) go to their last slots first.
    kv = torch.randn(2, 5, 2, 32, generator=g)[:, 1:3]
    new = torch.tensor([7, 60])
    expected_k = k_cache.index_copy(0, new, kv[:, 0])
    expected_v = v_cache.index_copy(0, new, kv[:, 1])
    out = kernels.decode_attention(q, kv[:, 0], kv[:, 1], k_cache, v_cache, new, slots, lens,
                                   32 ** -0.5)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for b in range(2):
        keys, values = (c[slots[b, :lens[b]]].transpose(0, 1) for c in (k_cache, v_cache))
        ref = F.scaled_dot_product_attention(q[b].view(2, 3, 32), keys, values)
        torch.testing.assert_close(out[b], ref.reshape(6, 32))


def test_decode_attention_splits_keys_when_heads_leave_a_thread_idle():
    """Batch 1 with 3 KV heads on 2 threads: each head's keys are split into ranges whose
    partial softmaxes are merged (and on one thread they are not); both equal SDPA, for
    sequence lengths that split evenly, unevenly and into ranges shorter than a part."""
    kernels, g = extension(), torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(512, 3, 64, generator=g), torch.randn(512, 3, 64, generator=g)
    slots = torch.randperm(512, generator=g)[:300].view(1, -1)
    threads = torch.get_num_threads()
    try:
        for n, num_threads in ((300, 2), (257, 2), (150, 2), (300, 1)):
            torch.set_num_threads(num_threads)
            q, kv = torch.randn(1, 9, 64, generator=g), torch.randn(1, 2, 3, 64, generator=g)
            new = slots[:, n - 1]
            out = kernels.decode_attention(q, kv[:, 0], kv[:, 1], k_cache, v_cache, new, slots,
                                           torch.tensor([n]), 0.125)
            keys, values = (c[slots[0, :n]].transpose(0, 1) for c in (k_cache, v_cache))
            ref = F.scaled_dot_product_attention(q[0].view(3, 3, 64), keys, values, scale=0.125)
            torch.testing.assert_close(out[0], ref.reshape(9, 64))
    finally:
        torch.set_num_threads(threads)


def test_host_pools_take_memory_as_they_are_written():
    before = psutil.Process().memory_info().rss
    pool = zeros((1 << 26, 2), torch.float32, "cpu")  # 512 MiB
    assert psutil.Process().memory_info().rss - before < 64 << 20
    assert pool[12345].eq(0).all() and pool[-1].eq(0).all()
    pool[7] = 3.0
    assert pool[7].eq(3.0).all() and pool[8].eq(0).all()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
def test_gemm_in_bfloat16_multiplies_the_rounded_weight_and_input(qtype):
    """A prefill's GEMM with bf16 (CPUs with native bfloat16): x and the dequantized weight are
    rounded to bfloat16 and multiplied, float32 out; batch 1 (the GEMV) is unchanged."""
    w = _blocks(48, 576, qtype, seed=3)
    reference = w.dequantize()
    x = torch.randn(CHUNKED_GEMV_ROWS + 8, 576, generator=torch.Generator().manual_seed(7))
    y = gguf_linear(x, w.blocks, w.qtype, 576, bf16=True)
    assert y.dtype == torch.float32
    rounded = x.bfloat16().float() @ reference.bfloat16().float().T
    torch.testing.assert_close(y, rounded, rtol=2e-2, atol=2e-2)
    assert not torch.equal(y, gguf_linear(x, w.blocks, w.qtype, 576))  # it did round
    torch.testing.assert_close(y, x @ reference.T, rtol=0.05, atol=0.15)
    one = x[:1]
    assert torch.equal(gguf_linear(one, w.blocks, w.qtype, 576, bf16=True),
                       gguf_linear(one, w.blocks, w.qtype, 576))


def test_bfloat16_gemms_only_where_the_cpu_multiplies_bfloat16(monkeypatch):
    from deepinfer.backends.cpu import kernels

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw"})
    assert not kernels.native_bf16_gemm()
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512f", flag})
        assert kernels.native_bf16_gemm()


def test_mixed_gguf_types_plan_row_ranges_of_each():
    """A fused linear weight loaded from GGUF tensors of several types the backend runs is
    planned as row ranges of each type (neighbours of one type merged), and built, loaded
    and dequantized as those parts; a gap, a float source or a type the backend lacks leaves
    it to be dequantized at load."""
    from torch import nn

    from deepinfer.models.quant.packed import gguf_block_kinds, parse_gguf_parts
    from deepinfer.models.quant.plan import packed_weight, plan_packed

    with torch.device("meta"):
        model = nn.Module()
        model.qkv = nn.Linear(256, 48, bias=False)
    runs = {"gguf:Q4_K", "gguf:Q6_K"}

    def plan(kinds: dict, rows: dict, backend: set = runs) -> dict:
        return plan_packed(model, kinds, lambda name: ("qkv.weight", rows[name]), backend)

    kinds = {"q": "gguf:Q4_K", "k": "gguf:Q4_K", "v": "gguf:Q6_K"}
    rows = {"q": (0, 32), "k": (32, 40), "v": (40, 48)}
    want = "gguf:Q4_K[0:40]+Q6_K[40:48]"
    assert plan(kinds, rows) == {"qkv.weight": want}
    assert plan(kinds, rows | {"v": (41, 48)}) == {}
    assert plan(kinds | {"v": "float"}, rows) == {}
    assert plan(kinds, rows, {"gguf:Q4_K"}) == {}
    assert gguf_block_kinds([want, "gguf:Q8_0"]) == {"gguf:Q4_K", "gguf:Q6_K", "gguf:Q8_0"}
    weight = packed_weight(want, (48, 256))
    assert isinstance(weight, GGUFParts) and weight.kind == want
    assert parse_gguf_parts(want) == [(0, 40, int(GGMLQuantizationType.Q4_K)),
                                      (40, 48, int(GGMLQuantizationType.Q6_K))]
    tensors = {name: _k_quant_blocks(end - start, 256, GGMLQuantizationType[k[5:]], seed=i)
               for i, (name, k, (start, end)) in
               enumerate((n, kinds[n], rows[n]) for n in ("q", "k", "v"))}
    for name in ("v", "q", "k"):  # any order: each lands in its part's rows
        weight.load_rows(tensors[name], rows[name])
    want_rows = torch.cat([tensors[n].dequantize() for n in ("q", "k", "v")])
    assert torch.equal(weight.dequantize(), want_rows)
    with pytest.raises(ValueError, match="not within one part"):
        weight.load_rows(tensors["v"], (36, 44))
