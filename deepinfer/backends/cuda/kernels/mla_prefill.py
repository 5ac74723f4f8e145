"""MLA prefill in the expanded ("MHA") form: each sequence's cached latents are decompressed into
per-head keys and values for the step, and the new tokens attend them as ordinary multi-head
attention, as DeepSeek, vLLM and SGLang run MLA prefill.

The absorbed form (mla_attention.paged_mla_prefill) scores and mixes all L + R = 576 latent
dims per head and pair: 2 x (576 + 512) FLOPs a head and pair. Expanded, a pair costs
2 x (128 + 64 + 128) = 640, 3.4x fewer, for a decompression GEMM of 2 x L x H x (nope + v)
FLOPs per context token. A prompt of a few hundred tokens or more repays it; a short chunk over
a long cached prefix does not, nor does a step too small to repay the fixed costs: those keep
the absorbed kernel (expanded_prefill_pays).

    mla_expanded_prefill(q_nope [T, H, N], q_pe [T, H, R], latent_cache [slots, L + R],
                         w_uk [H, N, L], w_uv [H, L, V], ...) -> [T, H, V]

1. gather_context: every prefilling sequence's context rows (cached prefix and new tokens, all
   already in the cache) from the paged cache into one contiguous [C, L + R] tensor, sequence
   after sequence, with their starts [N + 1].
2. two GEMMs: k_nope = c @ W_UK^T [C, H, N] and v = c @ W_UV [C, H, V]; the rotary key k_pe is
   the rows' last R dims, one per token, shared by every head.
3. _expanded_prefill_kernel: flash-attention-2 forward, one program per (head, sequence,
   BLOCK_M new tokens), the score of a pair cut into its N and R parts; causal over the
   sequence's context, whose rows are contiguous.

A context of more than `piece_tokens` rows (a chunk over a long cached prefix) is decompressed
piece by piece: piece j holds every sequence's key positions [j P, (j + 1) P), the kernel
attends the new tokens over one piece at a time and leaves each row's log-sum-exp, and each
piece's output is merged into the running one by those (as split-K attention merges; vLLM's
MLA prefill does the same over its cached context). A piece then holds at most
piece_tokens / 2 rows, which with the second output buffer keeps the peak within that of a
fresh prompt of piece_tokens tokens.

The step gives the sequences' lengths on the host (AttentionMeta.prefill_seq_lens): eager steps
only, never inside a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda.kernels.online_softmax import softmax_tile
from deepinfer.backends.cuda.kernels.prefill_attention import PrefillConfig
from deepinfer.backends.cuda.settings import interpreted

_LOG2E = 1.0 / math.log(2.0)
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _expanded_prefill_kernel(
    QNope, QPe, KNope, KPe, V, CtxStarts, QueryStarts, SeqLens, Out, Lse,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kt, stride_kh, stride_et,
    stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    key_lo, key_hi,  # the piece's key positions: context row r of a sequence is key_lo + r
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PIECE: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # The last query tiles see the most keys: start them first so the grid's tail is short.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(QueryStarts + seq) - tl.load(QueryStarts)  # q and out start at row 0
    q_len = tl.load(QueryStarts + seq + 1) - tl.load(QueryStarts + seq)
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    ctx = tl.load(CtxStarts + seq).to(tl.int64)  # the sequence's row 0 in the context buffers
    seq_end = tl.minimum(seq_len, key_hi)  # the last key of the piece, exclusive
    first_pos = seq_len - q_len + m_block * BLOCK_M  # absolute position of the tile's row 0
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    pos = first_pos + tl.arange(0, BLOCK_M)
    rows = (q_start + offs_m).to(tl.int64)
    offs_n = tl.arange(0, NOPE)
    offs_r = tl.arange(0, ROPE)
    q_n = tl.load(QNope + rows[:, None] * stride_qt + head * stride_qh + offs_n[None, :],
                  mask=row_ok[:, None], other=0.0)
    q_r = tl.load(QPe + rows[:, None] * stride_pt + head * stride_ph + offs_r[None, :],
                  mask=row_ok[:, None], other=0.0)
    keys = (KNope + ctx * stride_kt + head * stride_kh, KPe + ctx * stride_et,
            V + ctx * stride_vt + head * stride_vh, stride_kt, stride_et, stride_vt, key_lo)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VDIM], tl.float32)
    # Keys below full_hi are visible to every row of the tile and all lie inside the piece:
    # whole tiles of them from key_lo run unmasked.
    full_hi = tl.maximum(tl.minimum(first_pos + 1, seq_end), key_lo)
    full_hi = key_lo + (full_hi - key_lo) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_pos + BLOCK_M, seq_end)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_n, q_r, keys, pos, seq_end, key_lo, full_hi,
                            qk_scale, False, PIECE, NOPE, ROPE, VDIM, BLOCK_N, PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_n, q_r, keys, pos, seq_end, full_hi, hi, qk_scale,
                            True, PIECE, NOPE, ROPE, VDIM, BLOCK_N, PRECISION)
    if PIECE:  # a row may see no key of this piece: it leaves 0 and a log-sum-exp of -inf
        seen = l_i > 0.0
        l_i = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + rows * stride_lt + head * stride_lh, lse, mask=row_ok)
    acc = acc / l_i[:, None]
    offs_v = tl.arange(0, VDIM)
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attend(acc, l_i, m_i, q_n, q_r, keys, pos, seq_end, lo, hi, qk_scale,
            MASKED: tl.constexpr, EMPTY_ROWS: tl.constexpr, NOPE: tl.constexpr,
            ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax of the query rows (at positions pos) over key tiles [lo, hi); MASKED
    applies the causal mask and the piece's end. EMPTY_ROWS: a row may see none of a masked
    tile's keys and none before (a piece that starts past its position)."""
    k_nope, k_pe, v, stride_kt, stride_et, stride_vt, key_lo = keys
    offs_n = tl.arange(0, NOPE)
    offs_r = tl.arange(0, ROPE)
    offs_v = tl.arange(0, VDIM)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < seq_end
        k64 = (key - key_lo).to(tl.int64)  # the key's row in the piece's buffers
        if MASKED:
            k = tl.load(k_nope + k64[:, None] * stride_kt + offs_n[None, :],
                        mask=key_ok[:, None], other=0.0)
            kr = tl.load(k_pe + k64[:, None] * stride_et + offs_r[None, :],
                         mask=key_ok[:, None], other=0.0)
            vt = tl.load(v + k64[:, None] * stride_vt + offs_v[None, :],
                         mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_nope + k64[:, None] * stride_kt + offs_n[None, :])
            kr = tl.load(k_pe + k64[:, None] * stride_et + offs_r[None, :])
            vt = tl.load(v + k64[:, None] * stride_vt + offs_v[None, :])
        s = tl.dot(q_n, tl.trans(k), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(kr), s, input_precision=PRECISION)
        # Past the piece's end lie keys a row would see: the causal mask alone keeps out only
        # those past the sequence.
        seen = (key[None, :] <= pos[:, None]) & key_ok[None, :]
        p, alpha, m_i, l_i = softmax_tile(s, seen, m_i, l_i, qk_scale, MASKED, EMPTY_ROWS)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_i


def expanded_dims_ok(nope: int, rope: int, value: int) -> bool:
    """The kernel's dims: powers of two of at least 16 (tl.arange and tl.dot)."""
    return all(d >= _MIN_DOT and d & (d - 1) == 0 for d in (nope, rope, value))


# The fewest (head, pair)s a step expands: below it the gather, the two GEMMs and the extra
# launches cost more than the FLOPs save (H200, bench_mla_prefill.py: V3's 128 heads over one
# 512-token prompt, 17M, ran 0.9x of the absorbed kernel, 16 such prompts, 269M, 3.2x; V2-Lite's
# 16 heads over one 2,048-token prompt, 34M, 0.7x, over one of 8,192, 537M, 2.6x).
MIN_EXPANDED_HEAD_PAIRS = 1 << 26


def expanded_prefill_pays(pairs: int, context: int, heads: int, kv_lora_rank: int, nope: int,
                          rope: int, value: int) -> bool:
    """Whether expanding beats the absorbed kernel: `pairs` causal (query, key) pairs over
    `context` decompressed rows (both summed over the step's prefilling sequences) of `heads`
    heads. In FLOPs, decompressing a row costs 2 x L x (N + V) a head and each pair saves
    2 x (L + R + L) - 2 x (N + R + V) a head; and the step must be big enough to repay its
    fixed costs (MIN_EXPANDED_HEAD_PAIRS)."""
    saved = 2 * (2 * kv_lora_rank + rope) - 2 * (nope + rope + value)
    return pairs * heads >= MIN_EXPANDED_HEAD_PAIRS and \
        pairs * saved > context * 2 * kv_lora_rank * (nope + value)


@dataclass(frozen=True)
class Piece:
    """Key positions [lo, hi) of every sequence, and how many of them each sequence has."""
    lo: int
    hi: int
    rows: tuple[int, ...]


def pieces_of(seq_lens: Sequence[int], piece_tokens: int | None) -> list[Piece]:
    """The key ranges a context is decompressed in: one piece when the whole context fits
    piece_tokens rows (None: always), else ranges of P positions with P x sequences <=
    piece_tokens, so that no piece holds more rows."""
    longest = max(seq_lens)
    if piece_tokens is None or sum(seq_lens) <= piece_tokens:
        return [Piece(0, longest, tuple(seq_lens))]
    span = max(1, piece_tokens // len(seq_lens))
    return [Piece(lo, lo + span, tuple(max(0, min(lo + span, n) - lo) for n in seq_lens))
            for lo in range(0, longest, span)]


def gather_context(latent_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, piece: Piece, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's latent rows at positions piece.lo .. piece.lo + rows - 1, sequence after
    sequence: ([sum(rows), L + R], int32 starts [N + 1]). The starts are computed on the
    device from seq_lens (a copy from the host would wait for the stream), the row count
    from the host's piece."""
    rows = (seq_lens.clamp(max=piece.hi) - piece.lo).clamp(min=0)
    starts = torch.nn.functional.pad(rows.cumsum(0), (1, 0)).to(torch.int32)
    row = torch.arange(sum(piece.rows), dtype=torch.int32, device=latent_cache.device)
    seq = torch.searchsorted(starts[1:], row, right=True)
    pos = (row - starts[seq]).long() + piece.lo
    slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size
    return latent_cache[slots], starts


def mla_expanded_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         w_uk: torch.Tensor, w_uv: torch.Tensor, block_tables: torch.Tensor,
                         query_starts: torch.Tensor, seq_lens: torch.Tensor,
                         host_seq_lens: Sequence[int], max_query_len: int, block_size: int,
                         scale: float, out: torch.Tensor | None = None,
                         cfg: PrefillConfig | None = None,
                         piece_tokens: int | None = None) -> torch.Tensor:
    """Causal MLA of packed new tokens over their sequences' paged latents, expanded.

    q_nope [T, H, N] and q_pe [T, H, R] (rotated; last dims contiguous, rows may be strided);
    latent_cache [num_slots, L + R] already holds every token's row, new ones included;
    w_uk [H, N, L], w_uv [H, L, V] (kv_b_proj's halves); block_tables int32 [S, max_blocks];
    query_starts int32 [S + 1] cumulative, its first entry q's row 0; seq_lens int32 [S] and
    the same on the host (host_seq_lens); cfg: the attention's tiles (default: _config's);
    piece_tokens: the most context rows decompressed at once (None: the whole context).
    Returns [T, H, V].
    """
    tokens, heads, _ = q_nope.shape
    value = w_uv.shape[2]
    if out is None:
        out = torch.empty((tokens, heads, value), dtype=q_nope.dtype, device=q_nope.device)
    if tokens == 0 or len(host_seq_lens) == 0:
        return out
    if piece_tokens is not None and sum(host_seq_lens) > piece_tokens:
        # In pieces, the second output buffer (at most piece_tokens new rows of H x V) takes
        # what half a piece's keys and values would (H x (N + V) a row, N = V in DeepSeek):
        # half as many rows a piece keeps the whole within a fresh prompt's buffers.
        piece_tokens = max(1, piece_tokens // 2)
    pieces = pieces_of(host_seq_lens, piece_tokens)
    args = (q_nope, q_pe, latent_cache, w_uk, w_uv, block_tables, query_starts, seq_lens,
            max_query_len, block_size, scale, cfg)
    if len(pieces) == 1:
        _attend_piece(*args, pieces[0], out, None)
        return out
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=out.device)
    part = torch.empty_like(out)
    part_lse = torch.empty_like(lse)
    for i, piece in enumerate(pieces):
        _attend_piece(*args, piece, out if i == 0 else part, lse if i == 0 else part_lse)
        if i:
            _merge_(out, lse, part, part_lse)
    return out


def _attend_piece(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                  w_uk: torch.Tensor, w_uv: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                  block_size: int, scale: float, cfg: PrefillConfig | None, piece: Piece,
                  out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The new tokens over one piece's keys into out (and each row's log-sum-exp into lse,
    where given)."""
    heads, nope, lora = w_uk.shape
    value, rope = w_uv.shape[2], q_pe.shape[-1]
    rows, starts = gather_context(latent_cache, block_tables, seq_lens, piece, block_size)
    context = rows.shape[0]
    c_kv, k_pe = rows[:, :lora], rows[:, lora:]
    k_nope = (c_kv @ w_uk.reshape(heads * nope, lora).t()).view(context, heads, nope)
    v = (c_kv @ w_uv.transpose(0, 1).reshape(lora, heads * value)).view(context, heads, value)
    cfg = cfg or _config(nope + rope, value)
    lse_t = out if lse is None else lse  # a stand-in the kernel never writes without PIECE
    lse_strides = (0, 0) if lse is None else (lse.stride(0), lse.stride(1))
    grid = (heads, seq_lens.shape[0], triton.cdiv(max_query_len, cfg.block_m))
    _expanded_prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, starts, query_starts, seq_lens, out, lse_t,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *lse_strides, scale * _LOG2E, piece.lo, piece.hi,
        NOPE=nope, ROPE=rope, VDIM=value, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        # Exact fp32 products for fp32 inputs (the default would round them to tf32).
        PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32", PIECE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _merge_(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor,
            part_lse: torch.Tensor) -> None:
    """out, lse <- the softmax-weighted mix of (out, lse) and (part, part_lse), in place, one
    pass and no temporaries. The first piece holds key 0, which every row sees: lse is finite;
    a part's -inf weighs 0."""
    tokens, heads, value = out.shape
    grid = (tokens, triton.cdiv(heads, _MERGE_HEADS))
    _merge_kernel[grid](out, lse, part, part_lse, out.stride(0), out.stride(1), lse.stride(0),
                        part.stride(0), part.stride(1), part_lse.stride(0), heads,
                        VDIM=value, BLOCK_H=_MERGE_HEADS)


_MERGE_HEADS = 16


@triton.jit
def _merge_kernel(Out, Lse, Part, PartLse, stride_ot, stride_oh, stride_lt, stride_pt,
                  stride_ph, stride_qt, heads, VDIM: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < heads
    lse = tl.load(Lse + t * stride_lt + h, mask=ok, other=0.0)
    part_lse = tl.load(PartLse + t * stride_qt + h, mask=ok, other=float("-inf"))
    top = tl.maximum(lse, part_lse)
    w_out = tl.exp(lse - top)
    w_part = tl.exp(part_lse - top)
    total = w_out + w_part
    cols = tl.arange(0, VDIM)
    o_ptr = Out + t * stride_ot + h[:, None] * stride_oh + cols[None, :]
    p_ptr = Part + t * stride_pt + h[:, None] * stride_ph + cols[None, :]
    o = tl.load(o_ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    p = tl.load(p_ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    mixed = (o * w_out[:, None] + p * w_part[:, None]) / total[:, None]
    tl.store(o_ptr, mixed.to(Out.dtype.element_ty), mask=ok[:, None])
    tl.store(Lse + t * stride_lt + h, top + tl.log(total), mask=ok)


def _config(qk_dim: int, value: int) -> PrefillConfig:
    """Small tiles under the interpreter (tests meet many tile edges). On the GPU the query
    rows (qk_dim wide) and the [BLOCK_M, V] fp32 accumulator stay in registers: 8 warps for
    128 rows at DeepSeek's 192 / 128."""
    if interpreted():
        return PrefillConfig(16, 16, 4, 1)
    if qk_dim + value > 256:
        # H200, bench_mla_prefill.py --sweep: the best of 22 tile sets from 1 x 2,048 to 4,096
        # over 28,672 tokens at 128 and 16 heads, 17-21% ahead of 2 stages at 8K and more.
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(128, 64, 4, 2)
