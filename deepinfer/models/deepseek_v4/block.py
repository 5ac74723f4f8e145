"""One DeepSeek-V4 decoder layer over a flat token list of several sequences.

As transformers' DeepseekV4DecoderLayer: the attention block, then the MLP block, each between
a hyper-connection collapse of the residual streams and an update of them; the blocks' outputs
are cast back to the streams' dtype before the update.

The attention block, per step: project every token (q, one K=V vector), write every K=V
vector into the layer's window pages; then per sequence: run the compressor (and a CSA
layer's indexer compressor) over its new tokens from its state slot, write the entries they
emit into the compressed pages, gather its window keys and its compressed entries so far, let
the indexer pick (CSA) or the causal limit bound (HCA) the entries each query sees, and
attend (attention.attend, the reference the attention tests compare with transformers).
Projections run once over the whole step; only the compressor steps, the gathers and the
attention itself are per sequence. A decode-only step attends in one batched op per layer
(`ops.compressed_decode_attention`, after `ops.indexer_topk` on CSA layers), which a backend
serves with kernels over the pages (CUDA) or with the per-sequence reference (paged_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from deepinfer.models.deepseek_v4 import static
from deepinfer.models.deepseek_v4.attention import RMSNorm, V4Attention, attend, entries_visible
from deepinfer.models.deepseek_v4.cache import SeqView, V4PagedCache
from deepinfer.models.deepseek_v4.compressor import (
    PAGE_TOKENS,
    Compressed,
    Compressor,
    CompressorState,
    CSACompressor,
    build_compressor,
    causal_entry_limit,
    select_topk,
)
from deepinfer.models.deepseek_v4.hyper import HyperConnection, HyperDims
from deepinfer.models.ops import ModelOps


@dataclass(frozen=True)
class Placement:
    """Where one model layer keeps its cache."""

    window_layer: int  # the spec layer of its sliding window (the model layer's own index)
    entries_layer: int | None  # the spec layer of its compressed entries (CSA / HCA)
    state_offset: int  # elements into a sequence's state slot where its compressors' start


@dataclass(frozen=True)
class _Projected:
    """A compressed layer's projections of every token of the step (one matmul each)."""

    kv: torch.Tensor  # [T, width] compressor kv_proj
    gate: torch.Tensor  # [T, width] compressor gate_proj
    index_kv: torch.Tensor | None = None  # CSA: the indexer compressor's
    index_gate: torch.Tensor | None = None
    index_q: torch.Tensor | None = None  # CSA: roped index queries [T, heads, index_head_dim]
    index_w: torch.Tensor | None = None  # CSA: index head weights [T, heads] float32


@dataclass(frozen=True)
class _CompressorStep:
    """One compressor of a layer over the step's rows: its entry tensor, and where its part
    of a state slot and of a page's carry-over start."""

    compressor: Compressor
    kv: torch.Tensor
    gate: torch.Tensor
    entry: int  # 0: compressed, 1: index_key
    state_offset: int
    page_offset: int


class V4DecoderLayer(nn.Module):
    """Parameters under transformers' names (attn_hc, ffn_hc, input_layernorm,
    post_attention_layernorm, self_attn incl. self_attn.compressor, mlp)."""

    def __init__(self, config: PretrainedConfig, index: int, ops: ModelOps, mlp: nn.Module,
                 place: Placement) -> None:
        super().__init__()
        hyper = HyperDims.from_config(config)
        self.attn_hc, self.ffn_hc = HyperConnection(hyper, ops), HyperConnection(hyper, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = V4Attention(config, index)
        compressor = build_compressor(config, config.layer_types[index])
        if compressor is not None:  # transformers' place for it: self_attn.compressor
            self.self_attn.compressor = compressor
        self.mlp, self.place, self.ops = mlp, place, ops

    @property
    def compressor(self) -> Compressor | None:
        return getattr(self.self_attn, "compressor", None)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                paged: V4PagedCache) -> torch.Tensor:
        """streams [T, hc_mult, H] -> the layer's new streams."""
        x, mix = self.attn_hc.collapse(streams)
        out = self.attention(self.input_layernorm(x), positions, paged)
        streams = self.attn_hc.update(streams, mix, out.to(streams.dtype))
        x, mix = self.ffn_hc.collapse(streams)
        out = self.mlp(self.post_attention_layernorm(x), token_ids)
        return self.ffn_hc.update(streams, mix, out.to(streams.dtype))

    # ---- attention ------------------------------------------------------------------------
    def attention(self, hidden: torch.Tensor, positions: torch.Tensor,
                  paged: V4PagedCache) -> torch.Tensor:
        attn, d = self.self_attn, self.self_attn.dims
        q_residual = attn.q_residual(hidden)
        q, kv = attn.project(hidden, positions, q_residual)
        paged.write_window(self.place.window_layer, kv)
        projected = self._project(hidden, q_residual, positions)
        if paged.static:
            return attn.output(self._static(q, projected, positions, paged), positions)
        if paged.decode:
            return attn.output(self._decode(q, projected, positions, paged), positions)
        out = torch.empty_like(q)
        for seq in paged.sequences:
            seen = {"compressed_kv": None, "compressed_visible": None}
            if projected is not None:
                seen.update(self._compressed(seq, projected, positions, paged))
            keys, key_positions = paged.window(seq, self.place.window_layer)
            out[seq.rows] = attend(q[seq.rows], positions[seq.rows], keys, key_positions,
                                   sinks=attn.sinks, window=d.sliding_window, scale=d.scale,
                                   **seen)
        return attn.output(out, positions)

    def _decode(self, q: torch.Tensor, projected: _Projected | None, positions: torch.Tensor,
                paged: V4PagedCache) -> torch.Tensor:
        """One query per sequence: compress every sequence's token, then one batched op."""
        d, lens = self.self_attn.dims, paged.decode_lens
        entries, picks = None, None
        if projected is not None:
            comp, layer = self.compressor, self.place.entries_layer
            self._compress_decode(projected, positions, paged)
            entries = paged.paged(layer, 0, comp.rate)
            if isinstance(comp, CSACompressor):
                indexer = comp.indexer
                picks = self.ops.indexer_topk(projected.index_q, projected.index_w,
                                              paged.paged(layer, 1, indexer.rate), lens,
                                              indexer.topk, indexer.softmax_scale)
        return self.ops.compressed_decode_attention(
            q, paged.paged(self.place.window_layer), entries, picks, lens, self.self_attn.sinks,
            d.sliding_window, d.scale)

    def _static(self, q: torch.Tensor, projected: _Projected | None, positions: torch.Tensor,
                paged: V4PagedCache) -> torch.Tensor:
        """Every token of the step at once, in shapes fixed by its bucket (static.py)."""
        d = self.self_attn.dims
        entries = visible = None
        if projected is not None:
            entries, visible = self._static_entries(projected, positions, paged)
        return static.attention(q, positions, paged.paged(self.place.window_layer),
                                d.sliding_window, entries, visible, self.self_attn.sinks,
                                d.scale)

    def _static_entries(self, projected: _Projected, positions: torch.Tensor,
                        paged: V4PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's entries written, then the ones each token attends to [T, E, D] and
        which it sees [T, E]: HCA every entry of the context bucket, masked causally; CSA
        the indexer's picks."""
        comp, layer = self.compressor, self.place.entries_layer
        for step in self._compressor_steps(projected):
            paged.static_compress(step.compressor, step.kv, step.gate, positions, layer,
                                  step.entry, step.state_offset, step.page_offset)
        entries = paged.paged(layer, 0, comp.rate)
        if not isinstance(comp, CSACompressor):
            every = static.bucket_entries(entries)
            limit = causal_entry_limit(positions, comp.rate)[:, None]
            return every, torch.arange(every.shape[1], device=limit.device)[None, :] < limit
        indexer = comp.indexer
        picks = static.indexer_picks(projected.index_q, projected.index_w,
                                     paged.paged(layer, 1, indexer.rate), positions,
                                     indexer.topk, indexer.softmax_scale)
        return entries.cache[entries.rows_at(picks.clamp(min=0))], picks >= 0

    def _project(self, hidden: torch.Tensor, q_residual: torch.Tensor,
                 positions: torch.Tensor) -> _Projected | None:
        comp = self.compressor
        if comp is None:
            return None
        kv, gate = comp.linear(comp.kv_proj, hidden), comp.linear(comp.gate_proj, hidden)
        if not isinstance(comp, CSACompressor):
            return _Projected(kv, gate)
        indexer = comp.indexer
        index_q, index_w = indexer.queries(hidden, q_residual, positions)
        return _Projected(kv, gate, indexer.linear(indexer.kv_proj, hidden),
                          indexer.linear(indexer.gate_proj, hidden),
                          index_q, index_w)

    def _compressed(self, seq: SeqView, projected: _Projected, positions: torch.Tensor,
                    paged: V4PagedCache) -> dict[str, torch.Tensor]:
        """attend's compressed arguments after this chunk's entries are written: the
        sequence's entries so far [N, D] and which of them each of its queries sees (HCA:
        compressed_visible [Q, N]; CSA: the indexer's picks [Q, k])."""
        comp, layer = self.compressor, self.place.entries_layer
        count = self._compress(seq, projected, paged)
        entries = paged.entries(seq, layer, comp.rate, count)
        query_positions = positions[seq.rows]
        if not isinstance(comp, CSACompressor):
            return {"compressed_kv": entries[0], "compressed_visible":
                    entries_visible(query_positions, count, comp.rate)}
        indexer, rows = comp.indexer, seq.rows
        picks = select_topk(projected.index_q[rows], projected.index_w[rows], query_positions,
                            entries[1], indexer.rate, indexer.topk, indexer.softmax_scale)
        return {"compressed_kv": entries[0], "picks": picks}

    def _compress_decode(self, projected: _Projected, positions: torch.Tensor,
                         paged: V4PagedCache) -> None:
        """_compress for one token of every sequence (DeepSeekV4Ops.compressor_decode): the entries
        whose windows close, the state slots and, CSA, the carry-over at page ends. Rows in
        runs of q tokens of a sequence (a verify step) step token j of every run at once."""
        q = paged.tokens_per_seq
        for j in range(q):
            rows = slice(None) if q == 1 else slice(j, None, q)
            self._compress_rows(projected, positions, paged, rows)

    def _compress_rows(self, projected: _Projected, positions: torch.Tensor,
                       paged: V4PagedCache, rows: slice) -> None:
        comp, layer = self.compressor, self.place.entries_layer
        for step in self._compressor_steps(projected):
            page_offset = step.page_offset if step.compressor.overlap else None
            target = paged.decode_target(layer, step.entry, comp.rate, step.state_offset,
                                         page_offset, rows)
            self.ops.compressor_decode(step.compressor, step.kv[rows].contiguous(),
                                       step.gate[rows].contiguous(),
                                       positions[rows].contiguous(), target)

    def _compressor_steps(self, projected: _Projected) -> list[_CompressorStep]:
        """The layer's compressors in their state slot's order: the compressor, then (CSA)
        its indexer's (the index keys: the same windows, its own weights)."""
        comp = self.compressor
        rows = [(comp, projected.kv, projected.gate)]
        if isinstance(comp, CSACompressor):
            rows.append((comp.indexer, projected.index_kv, projected.index_gate))
        steps, offset, page_offset = [], self.place.state_offset, 0
        for entry, (compressor, kv, gate) in enumerate(rows):
            steps.append(_CompressorStep(compressor, kv, gate, entry, offset, page_offset))
            offset += compressor.state_numel
            page_offset += compressor.page_state_numel
        return steps

    def _compress(self, seq: SeqView, projected: _Projected, paged: V4PagedCache) -> int:
        """Run the layer's compressors over the sequence's new tokens, from and back to its
        state slot, and write the entries they emit (and, CSA, the carry-over as of every page
        end of the chunk into that page); returns its entry count."""
        comp, layer = self.compressor, self.place.entries_layer
        # A chunk starting at a page end reads the carry-over the page stores: after a prefix
        # hit the state slot holds nothing of this sequence, and otherwise the two are equal.
        resume = isinstance(comp, CSACompressor) and seq.start > 0 \
            and seq.start % PAGE_TOKENS == 0
        stored = paged.page_state(seq, layer, seq.start // PAGE_TOKENS - 1) if resume else None
        ends = list(range((seq.start // PAGE_TOKENS + 1) * PAGE_TOKENS, seq.seq_len + 1,
                          PAGE_TOKENS))
        emitted, page_rows = [], []
        for step in self._compressor_steps(projected):
            compressor, n = step.compressor, step.compressor.page_state_numel
            slot = paged.state(seq, step.state_offset, compressor.state_numel)
            kv, gate = step.kv[seq.rows], step.gate[seq.rows]
            own = None if stored is None else stored[step.page_offset:step.page_offset + n]
            state = _start_state(compressor, seq, kv, slot, own)
            if ends and n:
                page_rows.append(compressor.page_end_rows(state, kv, gate, ends))
            emitted.append(_step(compressor, seq, kv, gate, state, slot))
        paged.write_entries(seq, layer, comp.rate, emitted[0].indices,
                            tuple(e.entries for e in emitted))
        if page_rows:
            paged.write_page_states(seq, layer, [e // PAGE_TOKENS - 1 for e in ends],
                                    torch.cat(page_rows, dim=1))
        return seq.seq_len // comp.rate


def _start_state(compressor: Compressor, seq: SeqView, kv: torch.Tensor, slot: torch.Tensor,
                 stored: torch.Tensor | None) -> CompressorState:
    """The carry-over before the sequence's chunk: fresh at position 0 (a first chunk, or a
    recompute after preemption), from its page at a page end, else from its state slot."""
    if seq.start == 0:
        return compressor.initial_state(kv.dtype, kv.device)
    if stored is not None:
        return compressor.resume_state(stored, seq.start)
    return compressor.unpack_state(slot, seq.start)


def _step(compressor: Compressor, seq: SeqView, kv: torch.Tensor, gate: torch.Tensor,
          state: CompressorState, slot: torch.Tensor) -> Compressed:
    """One compressor over one sequence's chunk; the state slot is rewritten."""
    out, state = compressor.compress(kv, gate, seq.start, state)
    # The new carry-over is a new tensor, or the old slot's own rows (unchanged).
    compressor.store_state(slot, state, kv, gate, seq.start)
    return out
