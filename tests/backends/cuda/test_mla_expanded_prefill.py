"""MLA prefill expanded into per-head keys and values (kernels/mla_prefill.py) against a dense
float64 reference of the un-absorbed attention, and, through CUDAOps, against the absorbed
form every other path runs (a mixed step's leading decodes included).

Latent rows sit in shuffled blocks with unused slots NaN (a read past a sequence shows up) and
the output is poisoned with NaN (an unwritten element shows up), as in test_mla_kernels.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_mla_kernels import DEVICE, _assert_close, _paged_latent, _slots

from deepinfer.backends.cuda.kernels.mla_prefill import (
    Piece,
    expanded_dims_ok,
    expanded_prefill_pays,
    mla_expanded_prefill,
    pieces_of,
)
from deepinfer.backends.cuda.step_inputs import AttentionMeta


def _weights(heads: int, nope: int, lora: int, value: int, dtype: torch.dtype,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w_uk = torch.randn(heads, nope, lora, generator=gen) / math.sqrt(lora)
    w_uv = torch.randn(heads, lora, value, generator=gen) / math.sqrt(lora)
    return w_uk.to(dtype).to(DEVICE), w_uv.to(dtype).to(DEVICE)


def _query(tokens: int, heads: int, nope: int, rope: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope and q_pe as the model has them: the two parts of one [T, H, N + R] projection."""
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype).to(DEVICE)
    return q[..., :nope], q[..., nope:]


def _reference(q_nope, q_pe, kv, w_uk, w_uv, seq: int, scale: float) -> torch.Tensor:
    """Dense float64 attention of the last Q positions of sequence seq over its context's
    decompressed keys [k_nope | k_pe] and values."""
    lora = w_uk.shape[-1]
    n = int(kv.seq_lens[seq])
    table = kv.block_tables[seq].cpu()
    rows = kv.cache.cpu()[_slots(table[: math.ceil(n / kv.block_size)], kv.block_size, n)]
    c, k_pe = rows[:, :lora].double(), rows[:, lora:].double()
    k_nope = torch.einsum("cl,hnl->hcn", c, w_uk.cpu().double())
    v = torch.einsum("cl,hlv->hcv", c, w_uv.cpu().double())
    qn, qp = q_nope.cpu().double().transpose(0, 1), q_pe.cpu().double().transpose(0, 1)
    scores = (qn @ k_nope.transpose(1, 2) + qp @ k_pe.T) * scale  # [H, Q, n]
    pos = torch.arange(n - q_nope.shape[0], n)[None, :, None]
    scores = scores.masked_fill(torch.arange(n)[None, None, :] > pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [Q, H, V]


# (H, N, R, L, V, block_size, dtype, [(cached prefix, new tokens)])
CASES = [
    (2, 16, 16, 32, 16, 4, torch.float32, [(0, 37), (0, 1), (0, 16)]),
    (4, 32, 16, 32, 32, 8, torch.float32, [(0, 20), (5, 1), (40, 35), (14, 16), (9, 7)]),
    (3, 16, 16, 64, 32, 16, torch.float32, [(23, 30), (0, 9)]),
    (4, 32, 16, 32, 16, 16, torch.bfloat16, [(30, 25), (0, 18), (3, 1)]),
]


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("heads,nope,rope,lora,value,block_size,dtype,chunks", CASES)
def test_expanded_prefill_matches_reference(heads, nope, rope, lora, value, block_size, dtype,
                                            chunks, pieces):
    """Whole contexts, and contexts decompressed in pieces merged by their log-sum-exps: in
    float32 at most a quarter of the context at a time (8-11 pieces), in bf16 at most half (a
    few pieces, as serving makes them: each merge rounds the running output to bf16)."""
    gen = torch.Generator().manual_seed(heads * 1000 + lora * 10 + block_size)
    kv = _paged_latent([p + n for p, n in chunks], lora + rope, block_size, dtype, gen)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q_nope, q_pe = _query(starts[-1], heads, nope, rope, dtype, gen)
    w_uk, w_uv = _weights(heads, nope, lora, value, dtype, gen)
    out = torch.full((starts[-1], heads, value), float("nan"), dtype=dtype, device=DEVICE)
    query_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = [p + n for p, n in chunks]
    piece_tokens = (sum(lens) // 2 if dtype == torch.float32 else sum(lens) - 1) \
        if pieces else None
    got = mla_expanded_prefill(q_nope, q_pe, kv.cache, w_uk, w_uv, kv.block_tables,
                               query_starts, kv.seq_lens, lens, max(n for _, n in chunks),
                               block_size, 0.2, out=out, piece_tokens=piece_tokens)
    assert got is out
    ref = torch.cat([_reference(q_nope[starts[i]:starts[i + 1]], q_pe[starts[i]:starts[i + 1]],
                                kv, w_uk, w_uv, i, 0.2) for i in range(len(chunks))])
    _assert_close(out, ref, dtype)


def test_a_mixed_step_through_the_ops_equals_the_absorbed_form(monkeypatch):
    """CUDAOps.mla_attention on a step of two decodes then two prompts (one over a cached
    prefix): decodes absorbed, prompts expanded; the whole equals MLAOps' absorbed form."""
    from deepinfer.backends.cuda import ops as cuda_ops
    from deepinfer.backends.cuda.ops import CUDAOps
    from deepinfer.models.mla_ops import MLAOps

    # A step this small never pays for expanding on a GPU (the interpreter expands whatever
    # can): expanded here whatever the device, as the step this test is about.
    monkeypatch.setattr(cuda_ops, "expanded_prefill_pays", lambda *args: True)

    heads, nope, rope, lora, value, bs = 2, 16, 16, 32, 16, 8
    chunks = [(9, 1), (30, 1), (0, 21), (12, 17)]  # (cached prefix, new tokens)
    gen = torch.Generator().manual_seed(7)
    kv = _paged_latent([p + n for p, n in chunks], lora + rope, bs, torch.float32, gen)
    tables, lens = kv.block_tables, kv.seq_lens
    positions = [p + j for p, n in chunks for j in range(n)]
    seq_of = [i for i, (_, n) in enumerate(chunks) for _ in range(n)]
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs
                          for s, p in zip(seq_of, positions)], device=DEVICE)
    latent = kv.cache[slots].clone()  # the step's rows, written again by the op
    starts = torch.tensor([0, 1, 2, 23, 40], dtype=torch.int32, device=DEVICE)
    q_nope, q_pe = _query(40, heads, nope, rope, torch.float32, gen)
    w_uk, w_uv = _weights(heads, nope, lora, value, torch.float32, gen)
    meta = AttentionMeta(slot_mapping=slots, block_tables=tables, seq_lens=lens,
                         query_starts=starts, max_query_len=21, decode=False, max_seq_len=39,
                         num_decodes=2, prefill_seq_lens=(21, 29),
                         prefill_pairs=21 * 22 // 2 + 17 * 12 + 17 * 18 // 2)
    ops = CUDAOps(cache=SimpleNamespace(layer=lambda layer: (kv.cache,), block_size=bs))
    assert ops._expands(q_nope, q_pe, w_uv, meta)
    got = ops.mla_attention(q_nope, q_pe, latent, w_uk, w_uv, 0, meta, 0.2)
    ref = MLAOps.mla_attention(ops, q_nope, q_pe, latent, w_uk, w_uv, 0, meta, 0.2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ops.expanded_context_limit = 20  # more context than the step's token budget: in pieces
    pieced = ops.mla_attention(q_nope, q_pe, latent, w_uk, w_uv, 0, meta, 0.2)
    torch.testing.assert_close(pieced, ref, rtol=1e-5, atol=1e-5)
    ops.mla_expanded_prefill = False  # DEEPINFER_CUDA_MLA_EXPANDED_PREFILL=0
    assert not ops._expands(q_nope, q_pe, w_uv, meta)


def test_pieces_hold_at_most_their_rows_and_cover_every_key():
    lens = [5, 40, 17]
    assert pieces_of(lens, None) == [Piece(0, 40, (5, 40, 17))]
    assert pieces_of(lens, 62) == [Piece(0, 40, (5, 40, 17))]  # the whole context fits
    pieces = pieces_of(lens, 24)  # 8 positions a piece for 3 sequences
    assert all(sum(p.rows) <= 24 for p in pieces)
    assert [sum(p.rows[i] for p in pieces) for i in range(3)] == lens
    assert pieces[0] == Piece(0, 8, (5, 8, 8)) and pieces[-1] == Piece(32, 40, (0, 8, 0))


def test_expanding_pays_for_long_prompts_not_short_chunks_over_long_prefixes():
    v3 = dict(heads=128, kv_lora_rank=512, nope=128, rope=64, value=128)
    assert expanded_prefill_pays(16 * 512 * 513 // 2, 16 * 512, **v3)  # 16 fresh prompts
    assert expanded_prefill_pays(2048 * 2049 // 2, 2048, **v3)
    # One 512-token prompt repays the FLOPs but not the fixed costs; 16 heads need more pairs.
    assert not expanded_prefill_pays(512 * 513 // 2, 512, **v3)
    assert not expanded_prefill_pays(2048 * 2049 // 2, 2048, **{**v3, "heads": 16})
    assert expanded_prefill_pays(8192 * 8193 // 2, 8192, **{**v3, "heads": 16})
    assert not expanded_prefill_pays(256 * 257 // 2, 256, **v3)
    pairs = 128 * 32640 + 128 * 129 // 2  # 128 new tokens over a 32K prefix
    assert not expanded_prefill_pays(pairs, 32768, **v3)
    assert expanded_dims_ok(128, 64, 128) and not expanded_dims_ok(128, 48, 128)
    assert not expanded_dims_ok(8, 16, 16)


def test_the_latent_rows_are_made_in_place_when_the_rope_key_is_a_view():
    """CUDAOps.mla_latent returns kv_a_proj's output itself, c_kv normalized where it lies,
    when k_pe is that output's rotated rope columns (as the model hands them after the rotary
    kernel rotated them in place), and equals the reference (MLAOps: normalize, then join);
    a k_pe of its own takes the reference."""
    from deepinfer.backends.cuda.ops import CUDAOps
    from deepinfer.models.mla_ops import MLAOps

    g = torch.Generator().manual_seed(8)
    kv = torch.randn(5, 32 + 16, generator=g).to(DEVICE)
    weight = (1 + torch.rand(32, generator=g)).to(DEVICE)
    ops = CUDAOps(cache=None)
    ref = MLAOps.mla_latent(ops, kv.clone(), kv[:, 32:].clone(), weight, 1e-6)
    assert not torch.equal(ref[:, :32], kv[:, :32])  # the norm changed c_kv
    latent = ops.mla_latent(kv, kv[:, 32:], weight, 1e-6)
    assert latent.data_ptr() == kv.data_ptr()
    torch.testing.assert_close(latent, ref, rtol=1e-5, atol=1e-5)
    apart = kv[:, 32:].clone()
    joined = ops.mla_latent(torch.randn(5, 48, generator=g).to(DEVICE), apart, weight, 1e-6)
    assert joined.data_ptr() != apart.data_ptr() and torch.equal(joined[:, 32:], apart)
