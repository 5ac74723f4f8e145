"""The CUDA backend's elementwise Triton kernels against the torch reference ops.

Without a GPU they run under TRITON_INTERPRET=1 (see conftest.py) on CPU tensors. Activations
come as strided views of a fused qkv output, outputs are poisoned first, and bf16 results are
held to the reference's own rounding (at most one bf16 ulp apart).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bf16_rounding import rtne_bf16

from deepinfer.backends.cuda.kernels.activation import silu_and_mul
from deepinfer.backends.cuda.kernels.kv_write import store_kv
from deepinfer.backends.cuda.kernels.norm import add_rms_norm, rms_norm
from deepinfer.backends.cuda.kernels.rotary import apply_rotary_, rotary_store_kv_
from deepinfer.backends.torch import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
T, HQ, HK, D = 5, 4, 2, 32


pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).to(dtype=dtype, device=DEVICE)


def _fused_qkv(tokens: int, dtype: torch.dtype, d: int = D):
    """q [T, HQ, d], k and v [T, HK, d]: views of one [T, (HQ + 2 HK) d] projection output."""
    qkv = _randn(tokens, (HQ + 2 * HK) * d, dtype=dtype)
    q, k, v = qkv.split([HQ * d, HK * d, HK * d], dim=-1)
    return qkv, q.view(tokens, HQ, d), k.view(tokens, HK, d), v.view(tokens, HK, d)


def _assert_within_one_ulp(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16: equal, or one ulp apart where fp32 reduction order flips a rounding; fp32: ~1e-6."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out, ref = out.cpu(), ref.cpu()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    ulp = torch.pow(2.0, (torch.frexp(ref.float()).exponent - 8).float())
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ulp).all()), f"max diff {diff.max()} ulps {(diff / ulp).max()}"
    assert (diff > 0).float().mean() < 0.02  # nearly all bit-identical


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows(dtype):
    torch.manual_seed(0)
    x = _randn(T, 96, dtype=dtype)[:, :80]  # token stride 96, width 80 (not a power of two)
    weight = _randn(80, dtype=dtype)
    out = torch.full((T, 80), float("nan"), dtype=dtype, device=DEVICE)
    assert rms_norm(x, weight, 1e-6, out=out) is out
    _assert_within_one_ulp(out, ops.rms_norm(x, weight, 1e-6))
    _assert_within_one_ulp(rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_views(dtype):
    torch.manual_seed(1)
    qkv, q, k, v = _fused_qkv(T, dtype)
    weight = _randn(D, dtype=dtype)
    ref_q, ref_k = ops.rms_norm(q, weight, 1e-6), ops.rms_norm(k, weight, 1e-6)
    before_v = v.clone()
    _assert_within_one_ulp(rms_norm(q, weight, 1e-6), ref_q)
    rms_norm(k, weight, 1e-6, out=k)  # in place in the fused buffer, as Qwen3's k norm runs
    _assert_within_one_ulp(k, ref_k)
    assert torch.equal(v, before_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(T, 80), (T, HQ, D)])
def test_add_rms_norm(dtype, shape):
    torch.manual_seed(2)
    x = _randn(*shape, dtype=dtype)
    residual = _randn(*shape, dtype=dtype)
    weight = _randn(shape[-1], dtype=dtype)
    summed_ref = x + residual
    normed_ref = ops.rms_norm(summed_ref, weight, 1e-5)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert summed is residual  # the sum is written in place
    assert torch.equal(summed, summed_ref)
    _assert_within_one_ulp(normed, normed_ref)


def _rope_tables(max_positions: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float().to(DEVICE), emb.sin().float().to(DEVICE)


def _rope_float64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return ops.apply_rotary(x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [D, D // 2])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary(dtype, rot, pos_dtype):
    torch.manual_seed(3)
    qkv, q, k, v = _fused_qkv(T, dtype)
    cos, sin = _rope_tables(64, rot)
    positions = torch.randint(0, 64, (T,), dtype=pos_dtype, device=DEVICE)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    apply_rotary_(q, k, positions, cos, sin)
    c, s = cos[positions.long()], sin[positions.long()]
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the fp32 result
    for out, x in ((q, q0), (k, k0)):
        torch.testing.assert_close(out.double(), _rope_float64(x, c, s), rtol=tol, atol=tol)
        assert torch.equal(out[..., rot:], x[..., rot:])
        reference = ops.apply_rotary(x, c.unsqueeze(1).to(dtype), s.unsqueeze(1).to(dtype))
        torch.testing.assert_close(out, reference, rtol=max(tol, 2e-2), atol=max(tol, 2e-2))
    assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [D, D // 2])
def test_rotary_store_kv_equals_rotary_then_store(dtype, rot):
    """The fused decode path writes exactly what rotating in place and then storing writes."""
    torch.manual_seed(6)
    tokens, num_slots = 6, 30
    _, q, k, v = _fused_qkv(tokens, dtype)
    cos, sin = _rope_tables(64, rot)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    slots = torch.randperm(num_slots)[:tokens].to(DEVICE)
    slots[2] = -1  # a padding row
    caches = [torch.full((num_slots, HK, D), fill, dtype=dtype, device=DEVICE)
              for fill in (-7.0, -9.0)]
    ref_q, ref_k = q.clone(), k.clone()
    ref_caches = [c.clone() for c in caches]
    apply_rotary_(ref_q, ref_k, positions, cos, sin)
    store_kv(ref_k, v, *ref_caches, slots)
    k0 = k.clone()
    rotary_store_kv_(q, k, v, positions, cos, sin, *caches, slots)
    assert torch.equal(q, ref_q)
    assert torch.equal(k, k0)  # k is read, not rotated in place
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_with_qk_norm_equals_norms_then_rotary(dtype):
    """Qwen3's per-head q/k RMSNorm in the rotary pass: what rms_norm of q and of k, then the
    fused rotary + store, give (fp32 reductions may flip a bf16 rounding: one ulp)."""
    torch.manual_seed(8)
    tokens, num_slots = 6, 30
    _, q, k, v = _fused_qkv(tokens, dtype)
    q.mul_(3.0)  # rows far from unit RMS, so the norm matters
    cos, sin = _rope_tables(64, D)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    slots = torch.randperm(num_slots)[:tokens].to(DEVICE)
    slots[4] = -1
    q_w, k_w = (1.0 + 0.5 * _randn(D)).to(dtype), (1.0 + 0.5 * _randn(D)).to(dtype)
    caches = [torch.full((num_slots, HK, D), -7.0, dtype=dtype, device=DEVICE) for _ in "kv"]
    ref_caches = [c.clone() for c in caches]
    ref_q = rms_norm(q, q_w, 1e-6)
    rotary_store_kv_(ref_q, rms_norm(k, k_w, 1e-6), v, positions, cos, sin, *ref_caches, slots)
    rotary_store_kv_(q, k, v, positions, cos, sin, *caches, slots, qk_norm=(q_w, k_w, 1e-6))
    _assert_within_one_ulp(q, ref_q)
    for cache, ref in zip(caches, ref_caches):
        _assert_within_one_ulp(cache, ref)
    with pytest.raises(ValueError, match="cover the head"):
        half_cos, half_sin = _rope_tables(64, D // 2)
        rotary_store_kv_(q, k, v, positions, half_cos, half_sin, *caches, slots,
                         qk_norm=(q_w, k_w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(4)
    f = 300
    x = _randn(T, 2 * f + 8, dtype=dtype)[:, : 2 * f]  # a token stride wider than 2F
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = torch.full((T, f), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    _assert_within_one_ulp(out, ref)
    _assert_within_one_ulp(silu_and_mul(x), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv(dtype, slot_dtype):
    torch.manual_seed(5)
    tokens, num_slots = 7, 40
    _, _, k, v = _fused_qkv(tokens, dtype)
    k_cache = torch.full((num_slots, HK, D), -7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full((num_slots, HK, D), -9.0, dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_slots)[:tokens]
    slots[[1, 4]] = -1  # padding tokens
    store_kv(k, v, k_cache, v_cache, slots.to(dtype=slot_dtype, device=DEVICE))
    kept = slots >= 0
    assert torch.equal(k_cache[slots[kept]], k[kept])
    assert torch.equal(v_cache[slots[kept]], v[kept])
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert bool((k_cache[untouched] == -7).all()) and bool((v_cache[untouched] == -9).all())


def test_empty_batch():
    _, q, k, v = _fused_qkv(0, torch.bfloat16)
    weight = _randn(D, dtype=torch.bfloat16)
    assert rms_norm(q, weight, 1e-6).shape == (0, HQ, D)
    normed, summed = add_rms_norm(q, q.clone(), weight, 1e-6)
    assert normed.shape == summed.shape == (0, HQ, D)
    cos, sin = _rope_tables(8, D)
    apply_rotary_(q, k, torch.zeros(0, dtype=torch.int64, device=DEVICE), cos, sin)
    assert silu_and_mul(_randn(0, 2 * D, dtype=torch.bfloat16)).shape == (0, D)
    cache = torch.zeros(4, HK, D, dtype=torch.bfloat16, device=DEVICE)
    store_kv(k, v, cache, cache.clone(), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert not cache.any()


def test_bf16_rounding_helper_is_round_to_nearest_even():
    x = torch.randn(4096) * 100
    x[:3] = torch.tensor([math.inf, -math.inf, 0.0])
    got = torch.from_numpy(rtne_bf16(x.numpy()).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got, x.to(torch.bfloat16))
