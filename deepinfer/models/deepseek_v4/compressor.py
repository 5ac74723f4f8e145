"""DeepSeek-V4's KV compressors and Lightning indexer, one sequence's chunk at a time.

transformers (models/deepseek_v4/modeling_deepseek_v4.py) runs them over a batch with a
growing per-layer cache; here they run over one sequence's chunk of new tokens at absolute
positions [p0, p0 + n) with an explicit carry-over `CompressorState`, so an engine can feed a
flat token list split into arbitrary prefill chunks and decode steps, write the emitted
entries into pages and keep the carry-over in a fixed-size state slot.

Compression (HCA: rate m'=128, width head_dim; CSA: rate m=4, width 2 * head_dim; the CSA
indexer: rate 4, width 2 * index_head_dim). kv = kv_proj(h), z = gate_proj(h) per token.
Window w holds tokens [w*m, (w+1)*m). Entry w is
    kv_norm(sum_j softmax_j(z_j + position_bias[j]) * kv_j)       (softmax per channel, fp32)
roped (interleaved pairs, trailing rope dims, "compress" rope theta and YaRN) at position w*m.
HCA pools the m tokens of window w. CSA's windows overlap: each token's row is two series,
Ca = [:head_dim] and Cb = [head_dim:]; entry w pools Ca of window w-1 and Cb of window w
(2m slots, stride m; entry 0 has no Ca half, its slots get gate -inf).
A query at position p may see entries w < (p + 1) // m (the whole window is at or before p).
Indexer: q_I = rope(q_b_proj(q_residual)) per index head, w_I = weights_proj(h) / sqrt(heads),
score(t, s) = sum_h w_I[t,h] * ReLU(q_I[t,h] . K_I[s]) / sqrt(index_head_dim), masked to the
visible entries; the top min(index_topk, T) are kept, with -1 for picks that are not visible.

State (what transformers' DeepseekV4HCACache / DeepseekV4CSACache buffer between calls): the
kv/gate rows of the open window (num_tokens % m < m rows, position bias not yet added) and,
for CSA and its indexer, the Ca rows of the last closed window (m rows of head_dim, kv and
gate, also without the bias). As a fixed slot (`pack_state`, in the projections' dtype):
    HCA        2 * (m' - 1) * head_dim                      V4-Flash: 130,048 el (254 KiB bf16)
    CSA        2 * (m - 1) * 2 * head_dim + 2 * m * head_dim          10,240 el ( 20 KiB bf16)
    indexer    same with index_head_dim                                 2,560 el (  5 KiB bf16)
At a 128-token page boundary the open windows are empty (128 % m == 0): only the CSA and
indexer Ca rows are live. Entries per 128-token page: CSA 32 (+ 32 index keys), HCA 1; entry
w lies in page w * m // 128, and depends only on tokens before that page's end.
So each CSA layer also keeps those Ca rows as of every 128-token page end in the page itself
(`page_state`, compressor then indexer, kv then gate): a sequence resuming at a page end (a
prefix-cache hit, or any chunk that starts there) reads its carry-over from the pages it hits.

Dtypes as transformers loads V4 (_keep_in_fp32_modules_strict): position_bias and kv_norm stay
float32 and the projections run in the model dtype, so gates are promoted to fp32 and the
weighted sum runs in the model dtype; do not cast a whole Compressor to bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.core.kv.spec import CacheEntry
from deepinfer.models.deepseek_v4 import attention
from deepinfer.models.deepseek_v4.attention import RMSNorm, UsesOps, rope_inv_freq
from deepinfer.models.traits import Float32Params

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
PAGE_TOKENS = 128  # one page_state entry per this many tokens (every rate divides it)


@dataclass(frozen=True)
class CompressorState:
    """One compressor's carry-over for one sequence (position bias not added to any row)."""

    num_entries: int  # entries emitted so far; the open window starts at num_entries * rate
    tail_kv: torch.Tensor  # [num_tokens % rate, width] kv_proj rows of the open window
    tail_gate: torch.Tensor  # [num_tokens % rate, width] gate_proj rows of the open window
    prev_kv: torch.Tensor | None = None  # overlapping only: [rate, head_dim] Ca of window E-1
    prev_gate: torch.Tensor | None = None  # its gate rows; None until a window closed

    def num_tokens(self, rate: int) -> int:
        return self.num_entries * rate + self.tail_kv.shape[0]


@dataclass(frozen=True)
class Compressed:
    """Entries one chunk emitted: entries[i] is entry number indices[i] of the sequence."""

    entries: torch.Tensor  # [m, head_dim]
    indices: torch.Tensor  # [m] int64, consecutive


def state_numel(rate: int, head_dim: int, overlap: bool) -> int:
    """Elements of one compressor's fixed state slot (tail kv + gate, then Ca kv + gate)."""
    width = 2 * head_dim if overlap else head_dim
    return 2 * (rate - 1) * width + (2 * rate * head_dim if overlap else 0)


def layer_state_numel(config: PretrainedConfig, layer_type: str) -> int:
    """Elements of a layer's compressor state slots (CSA: compressor + indexer)."""
    if layer_type == HCA:
        return state_numel(config.compress_rates[HCA], config.head_dim, overlap=False)
    if layer_type == CSA:
        rate = config.compress_rates[CSA]
        return (state_numel(rate, config.head_dim, overlap=True)
                + state_numel(rate, config.index_head_dim, overlap=True))
    return 0


def layer_cache_entries(config: PretrainedConfig, layer_type: str) -> tuple[CacheEntry, ...]:
    """The paged entries of a layer (the sliding-window KV is state, not listed here)."""
    if layer_type == HCA:
        return (CacheEntry("compressed", (config.head_dim,), config.compress_rates[HCA]),)
    if layer_type == CSA:
        rate = config.compress_rates[CSA]
        page_state = 2 * rate * (config.head_dim + config.index_head_dim)
        return (CacheEntry("compressed", (config.head_dim,), rate),
                CacheEntry("index_key", (config.index_head_dim,), rate),
                CacheEntry("page_state", (page_state,), PAGE_TOKENS))
    return ()


def causal_entry_limit(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """How many entries a query at each position may see: w < (p + 1) // rate."""
    return torch.div(positions + 1, rate, rounding_mode="floor")


class Compressor(UsesOps, Float32Params, nn.Module):
    """One compressor's parameters under transformers' names, and its chunk step."""

    def __init__(self, config: PretrainedConfig, head_dim: int, rate: int, overlap: bool) -> None:
        super().__init__()
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        self.width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(config.hidden_size, self.width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, self.width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, self.width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        inv_freq, self.rope_scaling = rope_inv_freq(config, "compress")
        # Not persistent: transformers' rotary buffers are not in the checkpoint either.
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    def initial_state(self, dtype: torch.dtype, device: torch.device | None = None
                      ) -> CompressorState:
        empty = torch.zeros(0, self.width, dtype=dtype, device=device)
        return CompressorState(0, empty, empty)

    def forward(self, hidden: torch.Tensor, p0: int, state: CompressorState
                ) -> tuple[Compressed, CompressorState]:
        """hidden [n, hidden_size] of tokens at positions [p0, p0 + n)."""
        return self.compress(self.kv_proj(hidden), self.gate_proj(hidden), p0, state)

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, p0: int, state: CompressorState
                 ) -> tuple[Compressed, CompressorState]:
        """The step over already projected rows (an engine can project a whole batch at once)."""
        if p0 != state.num_tokens(self.rate):
            have = state.num_tokens(self.rate)
            raise ValueError(f"chunk starts at {p0}, the state has seen {have} tokens")
        kv = torch.cat([state.tail_kv, kv])
        gate = torch.cat([state.tail_gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        n_windows = usable // self.rate
        first = state.num_entries
        indices = torch.arange(first, first + n_windows, device=kv.device)
        if n_windows == 0:
            empty = kv.new_zeros(0, self.head_dim)
            return Compressed(empty, indices), CompressorState(
                first, kv, gate, state.prev_kv, state.prev_gate)
        win_kv = kv[:usable].view(n_windows, self.rate, self.width)
        win_gate_raw = gate[:usable].view(n_windows, self.rate, self.width)
        entries = self._pool(win_kv, win_gate_raw + self.position_bias, state)
        entries = self.rope(entries, indices * self.rate)
        prev_kv = prev_gate = None
        if self.overlap:  # only the Ca half is read again (by the next window)
            prev_kv = win_kv[-1, :, :self.head_dim].clone()
            prev_gate = win_gate_raw[-1, :, :self.head_dim].clone()
        # Clones: views would keep the whole chunk's rows alive until the next step.
        new_state = CompressorState(first + n_windows, kv[usable:].clone(),
                                    gate[usable:].clone(), prev_kv, prev_gate)
        return Compressed(entries, indices), new_state

    def _pool(self, win_kv: torch.Tensor, win_gate: torch.Tensor, state: CompressorState
              ) -> torch.Tensor:
        """Softmax-gated sum over each window's slots (transformers :428-430, :683-685)."""
        if self.overlap:
            win_kv, win_gate = self._overlap_slots(win_kv, win_gate, state)
        return self.pool_slots(win_kv, win_gate)

    def pool_slots(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """[n, slots, head_dim] rows and their biased gates -> n entries (before rope)."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))

    def _overlap_slots(self, win_kv: torch.Tensor, win_gate: torch.Tensor,
                       state: CompressorState) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, 2m, head_dim] slots: Ca of the previous window, then Cb of this one (:666-679).
        The same zero-kv / -inf-gate padding as transformers keeps the sums bit-identical."""
        n, r, d = win_kv.shape[0], self.rate, self.head_dim
        kv = win_kv.new_zeros((n, 2 * r, d))
        gate = win_gate.new_full((n, 2 * r, d), float("-inf"))
        kv[:, r:], gate[:, r:] = win_kv[..., d:], win_gate[..., d:]
        kv[1:, :r], gate[1:, :r] = win_kv[:-1, :, :d], win_gate[:-1, :, :d]
        if state.prev_kv is not None:
            kv[0, :r] = state.prev_kv.to(kv.dtype)
            gate[0, :r] = (state.prev_gate + self.position_bias[:, :d]).to(gate.dtype)
        return kv, gate

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """V4's interleaved rope (attention.py) with the "compress" parameters."""
        return self.roped(x, positions, self.rope_inv_freq, self.rope_scaling)

    @property
    def state_numel(self) -> int:
        return state_numel(self.rate, self.head_dim, self.overlap)

    @property
    def page_state_numel(self) -> int:
        """Elements of the carry-over at a page end: the last closed window's Ca kv + gate
        (the open window is empty there); 0 without overlap."""
        return 2 * self.rate * self.head_dim if self.overlap else 0

    def page_end_rows(self, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor,
                      ends: list[int]) -> torch.Tensor:
        """[len(ends), page_state_numel]: the carry-over as of each position in `ends`
        (window ends inside the chunk of raw rows kv/gate that follows `state`)."""
        base = state.num_entries * self.rate  # the position of the first tail row
        kv = torch.cat([state.tail_kv, kv])[:, :self.head_dim]
        gate = torch.cat([state.tail_gate, gate])[:, :self.head_dim]
        rows = [torch.cat([kv[e - base - self.rate:e - base].reshape(-1),
                           gate[e - base - self.rate:e - base].reshape(-1)]) for e in ends]
        return torch.stack(rows)

    def resume_state(self, flat: torch.Tensor, num_tokens: int) -> CompressorState:
        """The state at a page end from page_end_rows' packing [page_state_numel]."""
        n = self.rate * self.head_dim
        empty = flat.new_zeros(0, self.width)
        prev_kv, prev_gate = (flat[i * n:(i + 1) * n].view(self.rate, self.head_dim)
                              for i in range(2))
        return CompressorState(num_tokens // self.rate, empty, empty, prev_kv, prev_gate)

    def slot_shapes(self) -> list[tuple[int, int]]:
        """The state slot's parts in order: tail kv, tail gate, then (overlapping) Ca kv, gate."""
        shapes = [(self.rate - 1, self.width)] * 2
        return shapes + ([(self.rate, self.head_dim)] * 2 if self.overlap else [])

    def pack_state(self, state: CompressorState) -> torch.Tensor:
        """The state as a flat [state_numel] tensor; rows past the live ones are zero."""
        parts = [state.tail_kv, state.tail_gate]
        if self.overlap:
            parts += [state.prev_kv, state.prev_gate]
        flat = state.tail_kv.new_zeros(self.state_numel)
        offset = 0
        for part, (rows, cols) in zip(parts, self.slot_shapes()):
            if part is not None:
                flat[offset:offset + part.numel()] = part.reshape(-1)
            offset += rows * cols
        return flat

    def _slot_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for rows, cols in self.slot_shapes():
            views.append(flat[offset:offset + rows * cols].view(rows, cols))
            offset += rows * cols
        return views

    def store_state(self, flat: torch.Tensor, state: CompressorState, kv: torch.Tensor,
                    gate: torch.Tensor, p0: int) -> None:
        """Write a chunk's outcome into a slot laid out as pack_state's: each of its tokens'
        raw rows at tail row p % rate (a window's closing token has none), later positions
        over earlier ones, as the decode step writes them; then the carry-over. So the rows
        of a window the chunk closed stay in the slot until the next window's tokens
        replace them, and a verify step's rewind (rewind.py) finds its kept rows there.
        Rows no token of the chunk reaches keep what they held (no reader looks past the
        live tail)."""
        views, r, n = self._slot_views(flat), self.rate, kv.shape[0]
        i = max(0, n - r)  # earlier tokens' rows are written over by later ones
        while i < n:  # runs of consecutive rows, each ending at a window's last row
            row = (p0 + i) % r
            run = min(n - i, r - 1 - row)  # a closing token (row r - 1) has no row
            views[0][row:row + run], views[1][row:row + run] = kv[i:i + run], gate[i:i + run]
            i += run + 1
        if self.overlap and state.prev_kv is not None:
            views[2].copy_(state.prev_kv)
            views[3].copy_(state.prev_gate)

    def unpack_state(self, flat: torch.Tensor, num_tokens: int) -> CompressorState:
        """Inverse of pack_state; the engine knows num_tokens (num_computed_tokens)."""
        views = self._slot_views(flat)
        tail = num_tokens % self.rate
        prev = views[2:] if self.overlap and num_tokens >= self.rate else [None, None]
        return CompressorState(num_tokens // self.rate, views[0][:tail], views[1][:tail], *prev)


class _Scorer(nn.Module):
    """Holds weights_proj under transformers' name (DeepseekV4IndexerScorer)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)


class Indexer(Compressor):
    """The Lightning indexer: a CSA-rate compressor of index keys plus the query scorer."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, config.index_head_dim, config.compress_rates[CSA], overlap=True)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = _Scorer(config)
        self.softmax_scale = self.head_dim ** -0.5

    def queries(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(roped index queries [n, heads, index_head_dim], head weights [n, heads] fp32)."""
        q = self.linear(self.q_b_proj, q_residual).view(hidden.shape[0], self.num_heads,
                                                         self.head_dim)
        weights = self.linear(self.scorer.weights_proj, hidden).float() * self.num_heads ** -0.5
        return self.rope(q, positions), weights

    def select(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """Top-k entry indices [n, min(topk, T)] per query over all T index keys so far."""
        q, weights = self.queries(hidden, q_residual, positions)
        return select_topk(q, weights, positions, keys, self.rate, self.topk, self.softmax_scale)


def index_scores(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 keys: torch.Tensor, rate: int, softmax_scale: float) -> torch.Tensor:
    """[n, T] sum_h w[t,h] ReLU(q[t,h] . K[s]) * scale, -inf where s is not visible (:468-471).
    The [n, H, T] head scores are the big tensor of a long prefill: ReLU in place, then one
    batched GEMV sums the heads with the scale folded into the weights (two passes over it
    instead of four elementwise ones and a reduction)."""
    scores = torch.relu_(head_scores(q, keys))  # [n, H, T]
    weights = (weights.float() * softmax_scale).unsqueeze(1)  # [n, 1, H]
    scores = torch.bmm(weights, scores).squeeze(1)
    future = torch.arange(keys.shape[0], device=keys.device)[None, :] >= \
        causal_entry_limit(positions, rate)[:, None]
    return scores.masked_fill(future, float("-inf"))


def head_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 q[t, h] . K[s] for every head: [n, H, T]. On a GPU, half-precision inputs go
    through the tensor cores with float32 accumulation and output (their products are exact
    in float32, so this is the float32 GEMM up to summation order, at the bf16 rate)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and keys.dtype == q.dtype:
        n, heads, dim = q.shape
        flat = torch.mm(q.reshape(n * heads, dim), keys.t(), out_dtype=torch.float32)
        return flat.view(n, heads, keys.shape[0])
    return torch.matmul(q.float(), keys.float().t())


def select_topk(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                keys: torch.Tensor, rate: int, topk: int, softmax_scale: float) -> torch.Tensor:
    """The indexer's selection (:578-597): the top min(topk, T) entries by score, best first,
    with -1 for picks past the query's causal limit (fewer than topk visible entries)."""
    k = min(topk, keys.shape[0])
    if k == 0:
        return torch.zeros(q.shape[0], 0, dtype=torch.long, device=q.device)
    # In blocks of queries whose [n, H, T] scores fit (attention.MAX_SCORES): a long chunk's
    # would not.
    rows = max(1, attention.MAX_SCORES // (q.shape[1] * keys.shape[0]))
    picks = torch.cat([
        index_scores(q[i:i + rows], weights[i:i + rows], positions[i:i + rows], keys, rate,
                     softmax_scale).topk(k, dim=-1).indices
        for i in range(0, q.shape[0], rows)])
    invalid = picks >= causal_entry_limit(positions, rate)[:, None]
    return picks.masked_fill(invalid, -1)


class CSACompressor(Compressor):
    """The CSA compressor (rate 4, overlapping windows) with its indexer as `.indexer`, so a
    transformers `self_attn.compressor.*` state dict loads as is."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, config.head_dim, config.compress_rates[CSA], overlap=True)
        self.indexer = Indexer(config)


def build_compressor(config: PretrainedConfig, layer_type: str) -> Compressor | None:
    """The compressor of a layer type, None for sliding-only layers."""
    if layer_type == CSA:
        return CSACompressor(config)
    if layer_type == HCA:
        return Compressor(config, config.head_dim, config.compress_rates[HCA], overlap=False)
    return None
