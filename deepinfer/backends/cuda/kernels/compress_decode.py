"""One DeepSeek-V4 compressor's decode step in one kernel (DeepSeekV4Ops.compressor_decode; the
reference is models/deepseek_v4/decode_compress.py).

One program per sequence reads its token's projected kv/gate rows and position. A token that
does not close its window is stored as row p % rate of the state slot's open window, and the
program ends. A closing token pools the window: the softmax over its slots (with overlapping
windows the previous window's Ca rows, then this window's Cb rows) of gate + position bias,
weights and products rounded to the model's dtype as the reference's torch ops round them,
summed in float32; then the float32-weighted RMSNorm and the rope at the window's first
position, and the entry goes straight to its paged row. With overlapping windows the window's
Ca rows become the slot's carry-over (and, where the token ends a 128-token page, that page's
page_state columns).

Channels are handled as interleaved pairs (2i, 2i + 1), the layout of V4's rope, so the whole
step is elementwise per pair and the norm one reduction. The reference's ~25 torch launches a
compressor (gathers and scatters of the state slots, the dim-1 softmax, cats and wheres) become
one launch whose programs mostly return after one row store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.compressed_decode import _entry_rows
from deepinfer.backends.cuda.kernels.pdl import launch_kwargs
from deepinfer.models.deepseek_v4.compressor import PAGE_TOKENS
from deepinfer.models.deepseek_v4.paged_ops import DecodeTarget


@triton.jit
def _window_row(q, tail, new, WIDTH: tl.constexpr, RATE: tl.constexpr):
    """Row q of the closing window: the slot's open-window row q, or the token's own row."""
    if q < RATE - 1:
        ptr = tail + q * WIDTH
    else:
        ptr = new
    return ptr


@triton.jit
def _slot(s, kv_tail, gate_tail, kv_new, gate_new, prev_kv, prev_gate, Bias, i, ok,
          RATE: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr, OVERLAP: tl.constexpr):
    """(kv even, kv odd, gate even, gate odd) in float32 of pooling slot s, the gates biased.
    Overlapping: slots 0..RATE-1 are the previous window's Ca rows, then this one's Cb."""
    if OVERLAP:
        if s < RATE:
            kp = prev_kv + s * D
            gp = prev_gate + s * D
            bp = Bias + s * WIDTH
        else:
            kp = _window_row(s - RATE, kv_tail, kv_new, WIDTH, RATE) + D
            gp = _window_row(s - RATE, gate_tail, gate_new, WIDTH, RATE) + D
            bp = Bias + (s - RATE) * WIDTH + D
    else:
        kp = _window_row(s, kv_tail, kv_new, WIDTH, RATE)
        gp = _window_row(s, gate_tail, gate_new, WIDTH, RATE)
        bp = Bias + s * WIDTH
    ke = tl.load(kp + 2 * i, mask=ok, other=0.0).to(tl.float32)
    ko = tl.load(kp + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
    ge = tl.load(gp + 2 * i, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(bp + 2 * i, mask=ok, other=0.0)
    go = tl.load(gp + 2 * i + 1, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(bp + 2 * i + 1, mask=ok, other=0.0)
    return ke, ko, ge, go


@triton.jit
def _compress_decode_kernel(
    KV, Gate, Pos, States, Slots, Bias, NormW, Freq, Entries, Tables, PageState, PageTables,
    stride_kv, stride_gate, stride_state, stride_table, stride_entry, stride_page,
    stride_ptable, state_offset, page_offset, eps, scaling,
    RATE: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr, OVERLAP: tl.constexpr,
    ROPE_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr,
    HAS_PAGE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # see pdl.py
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(Pos + b)
    state = States + tl.load(Slots + b) * stride_state + state_offset
    kv_tail = state
    gate_tail = state + (RATE - 1) * WIDTH
    kv_new = KV + b * stride_kv
    gate_new = Gate + b * stride_gate
    j = p % RATE
    if j != RATE - 1:  # the window stays open: keep the token's rows
        cols = tl.arange(0, BLOCK_W)
        keep = cols < WIDTH
        tl.store(kv_tail + j * WIDTH + cols, tl.load(kv_new + cols, mask=keep), mask=keep)
        tl.store(gate_tail + j * WIDTH + cols, tl.load(gate_new + cols, mask=keep), mask=keep)
    else:
        row = _entry_rows(Tables + b * stride_table, p // RATE, True, BLOCK_SIZE, RATE)
        _pool(kv_tail, gate_tail, kv_new, gate_new, Bias, NormW, Freq,
              Entries + row * stride_entry, p, eps, scaling, RATE, D, WIDTH, OVERLAP,
              ROPE_HALF, BLOCK_HALF)
        if OVERLAP:
            tl.debug_barrier()  # every read of the old carry-over is done
            page = PageState + page_offset
            ends = (p + 1) % PAGE == 0
            if HAS_PAGE:
                if ends:
                    page += _entry_rows(PageTables + b * stride_ptable, p // PAGE, True,
                                        BLOCK_SIZE, PAGE) * stride_page
            _carry(kv_tail, gate_tail, kv_new, gate_new, page, ends & HAS_PAGE, RATE, D,
                   WIDTH, BLOCK_D)


@triton.jit
def _pool(kv_tail, gate_tail, kv_new, gate_new, Bias, NormW, Freq, entry, p, eps, scaling,
          RATE: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr, OVERLAP: tl.constexpr,
          ROPE_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The closing window's entry: softmax pooling, the norm, the rope, stored at `entry`."""
    prev_kv = gate_tail + (RATE - 1) * WIDTH
    prev_gate = prev_kv + RATE * D
    dtype = entry.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)
    ok = i < D // 2
    w = p // RATE
    first_slot = 0
    if OVERLAP:
        first_slot = tl.where(w == 0, RATE, 0)  # entry 0 has no previous window
    last_slot = 2 * RATE if OVERLAP else RATE
    m_e = tl.full([BLOCK_HALF], float("-inf"), tl.float32)
    m_o = tl.full([BLOCK_HALF], float("-inf"), tl.float32)
    for s in range(first_slot, last_slot):
        _, _, ge, go = _slot(s, kv_tail, gate_tail, kv_new, gate_new, prev_kv, prev_gate, Bias,
                             i, ok, RATE, D, WIDTH, OVERLAP)
        m_e, m_o = tl.maximum(m_e, ge), tl.maximum(m_o, go)
    l_e = tl.zeros([BLOCK_HALF], tl.float32)
    l_o = tl.zeros([BLOCK_HALF], tl.float32)
    for s in range(first_slot, last_slot):
        _, _, ge, go = _slot(s, kv_tail, gate_tail, kv_new, gate_new, prev_kv, prev_gate, Bias,
                             i, ok, RATE, D, WIDTH, OVERLAP)
        l_e += tl.exp(ge - m_e)
        l_o += tl.exp(go - m_o)
    acc_e = tl.zeros([BLOCK_HALF], tl.float32)
    acc_o = tl.zeros([BLOCK_HALF], tl.float32)
    for s in range(first_slot, last_slot):
        ke, ko, ge, go = _slot(s, kv_tail, gate_tail, kv_new, gate_new, prev_kv, prev_gate,
                               Bias, i, ok, RATE, D, WIDTH, OVERLAP)
        # The reference rounds the weights and each product to the model's dtype.
        we = (tl.exp(ge - m_e) / l_e).to(dtype).to(tl.float32)
        wo = (tl.exp(go - m_o) / l_o).to(dtype).to(tl.float32)
        acc_e += (ke * we).to(dtype).to(tl.float32)
        acc_o += (ko * wo).to(dtype).to(tl.float32)
    pe = tl.where(ok, acc_e.to(dtype).to(tl.float32), 0.0)
    po = tl.where(ok, acc_o.to(dtype).to(tl.float32), 0.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(pe * pe, 0) + tl.sum(po * po, 0)) / D + eps))
    ye = (pe * rstd * tl.load(NormW + 2 * i, mask=ok, other=0.0)).to(dtype).to(tl.float32)
    yo = (po * rstd * tl.load(NormW + 2 * i + 1, mask=ok, other=0.0)).to(dtype).to(tl.float32)
    # The rope at the window's first position, on the trailing 2 * ROPE_HALF channels.
    fi = i - (D // 2 - ROPE_HALF)
    roped = ok & (fi >= 0)
    angle = (w * RATE).to(tl.float32) * tl.load(Freq + fi, mask=roped, other=0.0)
    cos = tl.where(roped, (tl.cos(angle) * scaling).to(dtype).to(tl.float32), 1.0)
    sin = tl.where(roped, (tl.sin(angle) * scaling).to(dtype).to(tl.float32), 0.0)
    tl.store(entry + 2 * i, (ye * cos - yo * sin).to(dtype), mask=ok)
    tl.store(entry + 2 * i + 1, (yo * cos + ye * sin).to(dtype), mask=ok)


@triton.jit
def _carry(kv_tail, gate_tail, kv_new, gate_new, page, to_page, RATE: tl.constexpr,
           D: tl.constexpr, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    """The closing window's Ca rows (kv, raw gate) into the slot's carry-over, and where the
    token ends a page into its page_state columns (kv rows, then gate rows)."""
    prev_kv = gate_tail + (RATE - 1) * WIDTH
    prev_gate = prev_kv + RATE * D
    cols = tl.arange(0, BLOCK_D)
    keep = cols < D
    for q in range(0, RATE):
        kv = tl.load(_window_row(q, kv_tail, kv_new, WIDTH, RATE) + cols, mask=keep)
        gate = tl.load(_window_row(q, gate_tail, gate_new, WIDTH, RATE) + cols, mask=keep)
        tl.store(prev_kv + q * D + cols, kv, mask=keep)
        tl.store(prev_gate + q * D + cols, gate, mask=keep)
        if to_page:
            tl.store(page + q * D + cols, kv.to(page.dtype.element_ty), mask=keep)
            tl.store(page + (RATE + q) * D + cols, gate.to(page.dtype.element_ty), mask=keep)


def compress_decode(comp, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                    target: DecodeTarget) -> None:
    """DeepSeekV4Ops.compressor_decode for a models/deepseek_v4 Compressor on Triton."""
    batch = kv.shape[0]
    if batch == 0:
        return
    if kv.stride(-1) != 1 or gate.stride(-1) != 1 or not target.states.is_contiguous():
        raise ValueError("kv and gate rows and the state slots must be contiguous")
    d, width, rate = comp.head_dim, comp.width, comp.rate
    page = target.page_state
    page_cache = page.cache if page is not None else target.entries.cache
    page_tables = page.tables if page is not None else target.entries.tables
    _compress_decode_kernel[(batch,)](
        kv, gate, positions, target.states, target.slots, comp.position_bias,
        comp.kv_norm.weight, comp.rope_inv_freq, target.entries.cache, target.entries.tables,
        page_cache, page_tables, kv.stride(0), gate.stride(0), target.states.stride(0),
        target.entries.tables.stride(0), target.entries.cache.stride(0), page_cache.stride(0),
        page_tables.stride(0), target.offset, target.page_offset, comp.kv_norm.eps,
        float(comp.rope_scaling),
        RATE=rate, D=d, WIDTH=width, OVERLAP=comp.overlap,
        ROPE_HALF=comp.rope_inv_freq.shape[0], BLOCK_SIZE=target.entries.block_size,
        PAGE=PAGE_TOKENS, HAS_PAGE=page is not None,
        BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_W=triton.next_power_of_2(width),
        BLOCK_D=triton.next_power_of_2(d), num_warps=4, **launch_kwargs(kv.device))
