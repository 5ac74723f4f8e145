"""DeepSeek-V4's attention block in static shapes: every token of a step at once, for backends
that compile one graph per step shape (the Neuron backend).

The per-sequence path (block.py) loops over the step's sequences on the host and gathers as
many keys and state rows as each one has; its shapes follow the data. Here every token of the
flat step reads what it needs through index arithmetic on device tensors, each of a shape
fixed by the step's bucket: T tokens, a context bucket of W blocks (per-token block tables,
padded with the null block), the model's rates and window. Nothing is read back to the host.

Per token t at position p of a sequence whose chunk starts at `start`:

* compressors (compressor.py's math, each token as if it were the last of its chunk): the
  raw kv/gate rows of position q come from the chunk (q >= start, row t - (p - q)), from the
  open window's tail in the sequence's state slot (q in [start // rate * rate, start)) or,
  for the Ca half of overlapping windows, from the slot's last closed window (earlier). A
  chunk that starts at a page end after a prefix hit reads that window from the page's
  page_state instead, as the per-sequence path does. Each token computes the entry its
  window would close with; those that close one write it (the others write the null block).
  Where a 128-token page ends, the carry-over goes into the page. The state slot is written
  from each sequence's last token (`state_writes`; the other tokens write a scratch slot).
* the indexer (CSA): every entry of the context bucket scored, the invisible ones -inf, the
  top min(index_topk, entries of the bucket) kept, -1 for picks past the causal limit.
* attention: the `sliding_window` keys up to p, the visible compressed entries (HCA: all of
  the bucket's, masked; CSA: the picks) and the sink, in one softmax with the reference's
  arithmetic (attention._attend_block).

The step metadata (`STATIC_FIELDS` in cache.py) carries per token: its sequence's chunk start,
the state slot it reads and the slot it writes; per KV group, per-token block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.models.deepseek_v4.compressor import PAGE_TOKENS, Compressor, causal_entry_limit
from deepinfer.models.deepseek_v4.decode_compress import SlotRows
from deepinfer.models.deepseek_v4.paged_ops import PagedRows


@dataclass(frozen=True)
class TokenRows:
    """Where each token of the step finds the raw rows of one compressor: the chunk's own
    projections and its sequence's carry-over."""

    kv: torch.Tensor  # [T, width] this step's kv_proj rows
    gate: torch.Tensor  # [T, width]
    positions: torch.Tensor  # [T] long
    starts: torch.Tensor  # [T] long: the position of its sequence's first new token
    slots: SlotRows  # [T, ...] its sequence's state slot as the step found it
    rate: int
    head_dim: int

    def raw(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv, gate rows [T, n, width] of positions at [T, n] in the chunk or the open
        window's tail (positions outside both: junk, for the caller to mask)."""
        t = self.kv.shape[0]
        token = torch.arange(t, device=at.device)[:, None]
        own = (token + at - self.positions[:, None]).clamp(0, t - 1)
        tail = (at % self.rate).clamp(max=self.rate - 2)
        rows = torch.arange(t, device=at.device)[:, None].expand_as(at)
        in_chunk = (at >= self.starts[:, None])[..., None]
        return (torch.where(in_chunk, self.kv[own], self.slots.tail_kv[rows, tail]),
                torch.where(in_chunk, self.gate[own], self.slots.tail_gate[rows, tail]))

    def ca(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Ca half [T, n, head_dim] of positions at: the chunk or the tail, or before the
        open window, the last closed window's rows (overlapping compressors)."""
        d = self.head_dim
        kv, gate = self.raw(at)
        open_start = torch.div(self.starts, self.rate, rounding_mode="floor") * self.rate
        closed = (at < open_start[:, None])[..., None]
        rows = torch.arange(at.shape[0], device=at.device)[:, None].expand_as(at)
        column = at % self.rate
        return (torch.where(closed, self.slots.prev_kv[rows, column], kv[..., :d]),
                torch.where(closed, self.slots.prev_gate[rows, column], gate[..., :d]))


def compress(comp: Compressor, rows: TokenRows) -> torch.Tensor:
    """The entry [T, head_dim] each token's window pools when it closes, roped at the window's
    first position (meaningful where the token closes its window)."""
    r, d = comp.rate, comp.head_dim
    first = torch.div(rows.positions, r, rounding_mode="floor") * r
    window = first[:, None] + torch.arange(r, device=first.device)
    kv, gate = rows.raw(window)
    gate = gate + comp.position_bias
    if comp.overlap:  # Ca of the previous window, then Cb of this one
        prev_kv, prev_gate = rows.ca(window - r)
        has_prev = (first >= r)[:, None, None]
        prev_kv = torch.where(has_prev, prev_kv.to(kv.dtype), 0)
        prev_gate = torch.where(has_prev, prev_gate + comp.position_bias[:, :d], float("-inf"))
        kv = torch.cat((prev_kv, kv[..., d:]), dim=1)
        gate = torch.cat((prev_gate.to(gate.dtype), gate[..., d:]), dim=1)
    return comp.rope(comp.pool_slots(kv, gate), first)


def state_after(comp: Compressor, rows: TokenRows) -> torch.Tensor:
    """[T, state_numel]: the state slot as of each token, as pack_state lays it out (tail
    rows past the live ones zero)."""
    r = comp.rate
    ends = rows.positions + 1
    opened = torch.div(ends, r, rounding_mode="floor") * r
    tail_at = opened[:, None] + torch.arange(r - 1, device=ends.device)
    live = (tail_at < ends[:, None])[..., None]
    kv, gate = rows.raw(tail_at)
    tail = SlotRows(torch.where(live, kv, 0), torch.where(live, gate, 0), None, None)
    if not comp.overlap:
        return tail.pack()
    prev_kv, prev_gate = rows.ca(opened[:, None] - r + torch.arange(r, device=ends.device))
    closed = (opened >= r)[:, None, None]
    return SlotRows(tail.tail_kv, tail.tail_gate, torch.where(closed, prev_kv, 0),
                    torch.where(closed, prev_gate, 0)).pack()


def page_carry(comp: Compressor, rows: TokenRows) -> torch.Tensor:
    """[T, page_state_numel]: the Ca kv and gate rows of each token's window (the carry-over
    stored where a page ends, which closes a window)."""
    r = comp.rate
    first = torch.div(rows.positions, r, rounding_mode="floor") * r
    kv, gate = rows.ca(first[:, None] + torch.arange(r, device=first.device))
    return torch.cat((kv.flatten(1), gate.flatten(1)), dim=1)


def resumed_slots(comp: Compressor, slots: SlotRows, stored: torch.Tensor,
                  starts: torch.Tensor) -> SlotRows:
    """The slots with the last closed window taken from the page_state row `stored`
    [T, page_state_numel] where a sequence's chunk starts at a page end (after a prefix hit
    its slot holds nothing of it; otherwise the two are equal)."""
    n = comp.rate * comp.head_dim
    at_page = ((starts > 0) & (starts % PAGE_TOKENS == 0))[:, None, None]
    kv = stored[:, :n].view(-1, comp.rate, comp.head_dim).to(slots.prev_kv.dtype)
    gate = stored[:, n:2 * n].view(-1, comp.rate, comp.head_dim).to(slots.prev_gate.dtype)
    return SlotRows(slots.tail_kv, slots.tail_gate, torch.where(at_page, kv, slots.prev_kv),
                    torch.where(at_page, gate, slots.prev_gate))


def write_closed(entries: PagedRows, values: torch.Tensor, positions: torch.Tensor,
                 rate: int) -> None:
    """Each token's entry into entry number p // rate of its sequence where p closes the
    window; the others into row 0 (the null block, which no sequence reads)."""
    closes = positions % rate == rate - 1
    items = torch.div(positions, rate, rounding_mode="floor")
    target = torch.where(closes, entries.rows_of_each(items), 0)
    entries.cache.index_copy_(0, target, values.to(entries.cache.dtype))


def write_page_ends(pages: PagedRows, carry: torch.Tensor, positions: torch.Tensor,
                    offset: int) -> None:
    """The carry-over of each token that ends a page into columns [offset, offset + n) of its
    page's page_state row; the others into row 0."""
    ends = (positions + 1) % PAGE_TOKENS == 0
    page = torch.div(positions, PAGE_TOKENS, rounding_mode="floor")
    target = torch.where(ends, pages.rows_of_each(page), 0)
    pages.cache[target, offset:offset + carry.shape[1]] = carry.to(pages.cache.dtype)


# ---- the indexer and the attention ----------------------------------------------------------
def bucket_entries(entries: PagedRows) -> torch.Tensor:
    """[T, E, D]: entries 0..E-1 of each token's sequence, E the context bucket's count."""
    count = entries.tables.shape[1] * entries.block_size // entries.rate
    items = torch.arange(count, device=entries.cache.device)
    return entries.cache[entries.rows_at(items.expand(entries.tables.shape[0], -1))]


def indexer_picks(q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                  positions: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    """compressor.select_topk over the context bucket's index keys: [T, min(topk, E)] entry
    numbers, -1 past each query's causal limit."""
    own = bucket_entries(keys)  # [T, E, d]
    scores = torch.relu(torch.einsum("thd,ted->the", q.float(), own.float()))
    scores = torch.bmm((weights.float() * scale).unsqueeze(1), scores).squeeze(1)
    limit = causal_entry_limit(positions, keys.rate)[:, None]
    future = torch.arange(own.shape[1], device=q.device)[None, :] >= limit
    picks = scores.masked_fill(future, float("-inf")).topk(min(topk, own.shape[1])).indices
    return picks.masked_fill(picks >= limit, -1)


def attention(q: torch.Tensor, positions: torch.Tensor, window: PagedRows, width: int,
              entries: torch.Tensor | None, visible: torch.Tensor | None,
              sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, heads, D]: softmax over each token's window keys (the `width` positions up to
    its own), the entries [T, E, D] where visible [T, E], and one sink per head, as
    attention._attend_block computes it. Returns [T, heads, D] in q's dtype."""
    at = positions[:, None] - width + 1 + torch.arange(width, device=q.device)
    keys = window.cache[window.rows_at(at.clamp(min=0))]
    parts = [(keys, at >= 0)]
    if entries is not None:
        parts.append((entries.to(keys.dtype), visible))
    scores = [(torch.einsum("thd,tkd->thk", q, k) * scale).masked_fill(
        ~seen[:, None], float("-inf")) for k, seen in parts]
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([s.float() for s in scores] + [sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    out, start = None, 0
    for value, _ in parts:  # each part's weighted sum, added in float32, rounded once
        part = torch.einsum("thk,tkd->thd", probs[..., start:start + value.shape[1]],
                            value).float()
        out, start = part if out is None else out + part, start + value.shape[1]
    return out.to(q.dtype)
