"""Sampler: turns one step's logits into one token (and optional logprobs) per SamplingRow.

Order of operations, per row:
  1. logprobs from the RAW logits (what the model said, before any request processing: vLLM's
     default logprobs mode), so penalties, logit_bias, allowed_token_ids, grammars and
     temperature never change a reported logprob or rank, only which token is sampled;
  2. repetition / frequency / presence penalties;
  3. logit_bias: each listed token's bias is added to its logit;
  4. masks (-inf): min_tokens bans EOS and stop token ids until enough tokens were generated,
     allowed_token_ids bans every token it does not list, a grammar every token it rejects;
  5. greedy rows take the argmax;
  6. other rows: temperature, top-k, top-p, min-p, then an exponential race.

The race (argmax of probs / E, E ~ Exp(1)) draws a token with probability exactly probs, and its
noise comes from a generator seeded by (seed, step) only, so a seeded request samples the same
tokens whatever else shares its batch and wherever its row sits. All math runs in float32 on
the logits' device; the only host syncs are the final .tolist() calls.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.core.batch import SamplerOutput, SamplingRow, TokenLogprobs
from deepinfer.core.transfer import tensor_on

_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 2**63

MAX_TEMPERATURE = 1e4  # logits span far less than 1e4 nats: flat beyond this


def noise_seed(seed: int, step: int) -> int:
    """Generator seed for a row's noise: a function of (seed, step) only."""
    return (seed * _SEED_MULTIPLIER + step) % _SEED_MODULUS


def argmax_rows(logits: torch.Tensor, groups: int = 128) -> torch.Tensor:
    """logits.argmax(dim=-1) of [B, V], in two stages when V splits into `groups` equal parts.

    A GPU reduction with few output rows runs on few thread blocks: argmax over one 128K-entry
    row took 28 us on an H200 (0.6% of a batch-1 decode step); a max over [B, groups, V/groups]
    spreads it over the GPU. Ties resolve as torch's do, to the first maximal index: the first
    maximum within each part, then the first part holding the overall maximum.
    """
    batch, vocab = logits.shape
    if vocab % groups or vocab < 16 * groups:
        return logits.argmax(dim=-1)
    values, within = logits.view(batch, groups, vocab // groups).max(dim=-1)
    part = values.argmax(dim=-1, keepdim=True)
    return part.squeeze(1) * (vocab // groups) + within.gather(1, part).squeeze(1)


class Sampler:
    """Stateless: every call depends only on its arguments, so one instance serves all steps."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all_plain_greedy(rows):
            # argmax is unchanged by an exact upcast, so skip the float32 copy entirely.
            return SamplerOutput(argmax_rows(logits).tolist(), [None] * len(rows))
        tokens, logprobs = self._sample(logits, rows)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def sample_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """sample()'s token ids, left on the logits' device (int64 [rows]) with no host sync,
        for rows that ask for no logprobs (async scheduling reads them a step later)."""
        if logits.shape[0] != len(rows) or any(r.params.logprobs is not None for r in rows):
            raise ValueError("sample_tokens takes one row per logits row and no logprobs")
        if all_plain_greedy(rows):
            return argmax_rows(logits)
        return self._sample(logits, rows)[0]

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        # A private float32 copy: the steps below edit it in place, never the caller's tensor.
        logits = logits.detach().to(torch.float32, copy=True)
        device = logits.device
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = (torch.log_softmax(logits[_index(logprob_rows, device)], dim=-1)
                        if logprob_rows else None)

        _apply_penalties(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_min_tokens(logits, rows)
        _apply_allowed_tokens(logits, rows)
        _apply_bitmasks(logits, rows)

        tokens = argmax_rows(logits)  # final for greedy rows
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = _index(random_rows, device)
            tokens[index] = _sample_random(logits[index], [rows[i] for i in random_rows])

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            _fill_logprobs(logprobs, raw_logprobs, tokens, rows, logprob_rows)
        return tokens, logprobs


def all_plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Whether every row's token is its logits' argmax, with nothing else asked (no
    penalties, logit_bias, allowed_token_ids, logprobs, banned tokens or grammar): a backend's
    own argmax then serves."""
    return all(_is_plain_greedy(row) for row in rows)


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (params.greedy and not params.uses_penalties and not params.adjusts_logits
            and params.logprobs is None and len(row.output_token_ids) >= params.min_tokens
            and row.token_bitmask is None)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 words -> bool [vocab], True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[:, None] >> shifts) & 1
    allowed = bits.flatten().bool()
    if allowed.numel() < vocab:  # tokens the grammar's vocabulary lacks are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
    return allowed[:vocab]


def _apply_bitmasks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.token_bitmask is not None:
            allowed = unpack_bitmask(row.token_bitmask.to(logits.device), logits.shape[1])
            logits[i].masked_fill_(~allowed, float("-inf"))


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return tensor_on(positions, device)


def _column(values: list[float], device: torch.device,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row parameters as a [rows, 1] tensor that broadcasts over the vocabulary."""
    return tensor_on(values, device, dtype).unsqueeze(-1)


def _token_counts(token_lists: list[Sequence[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 occurrence counts; ids outside the vocabulary are ignored."""
    flat = [row * vocab + token for row, tokens in enumerate(token_lists)
            for token in tokens if 0 <= token < vocab]
    size = len(token_lists) * vocab
    if not flat:
        return torch.zeros(len(token_lists), vocab, device=device)
    counts = torch.bincount(_index(flat, device), minlength=size)
    return counts.view(len(token_lists), vocab).to(torch.float32)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (HF/vLLM, over prompt + output), then frequency and presence (OpenAI, over
    output only). In place, on the penalized rows only."""
    penalized = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not penalized:
        return
    device, vocab = logits.device, logits.shape[-1]
    params = [rows[i].params for i in penalized]
    output_counts = _token_counts([rows[i].output_token_ids for i in penalized], vocab, device)
    # The prompt only matters to the repetition penalty; skip flattening it otherwise.
    prompt_counts = _token_counts(
        [rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else ()
         for i, p in zip(penalized, params)], vocab, device)

    index = _index(penalized, device)
    sub = logits[index]
    repetition = _column([p.repetition_penalty for p in params], device)
    seen = (output_counts + prompt_counts) > 0
    # Dividing a positive logit and multiplying a negative one both push it down for p > 1.
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - _column([p.frequency_penalty for p in params], device) * output_counts
    sub = sub - _column([p.presence_penalty for p in params], device) * (output_counts > 0)
    logits[index] = sub


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """logits[row, token] += bias for every row's logit_bias, all rows in one scatter (in
    place). Ids past the logits' width (the engine refuses them) are skipped."""
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, bias in biased:  # list-level copies: a vocabulary-sized bias costs C loops only
        row_ids += [i] * len(bias)
        token_ids += bias.keys()
        values += bias.values()
    token_ids, row_ids, values = _in_vocab(logits.shape[-1], token_ids, row_ids, values)
    device = logits.device
    # Keys are unique per row, so accumulate only adds each bias once (and -inf stays -inf).
    logits.index_put_((_index(row_ids, device), _index(token_ids, device)),
                      tensor_on(values, device, torch.float32), accumulate=True)


def _in_vocab(vocab: int, token_ids: list[int], *columns: list) -> tuple[list, ...]:
    """token_ids and the columns beside them, less the entries whose id is past the logits'
    width (a Python loop only when there is one)."""
    if not token_ids or max(token_ids) < vocab:
        return (token_ids, *columns)
    kept = [k for k, token in enumerate(token_ids) if token < vocab]
    return tuple([column[k] for k in kept] for column in (token_ids, *columns))


def _apply_allowed_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """-inf for every token outside a row's allowed_token_ids (a mask, as a grammar's); one
    bool mask for the batch, filled in one scatter."""
    limited = [(i, row.params.allowed_token_ids) for i, row in enumerate(rows)
               if row.params.allowed_token_ids is not None]
    if not limited:
        return
    vocab, device = logits.shape[-1], logits.device
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, allowed in limited:
        row_ids += [i] * len(allowed)
        token_ids += allowed
    token_ids, row_ids = _in_vocab(vocab, token_ids, row_ids)
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    banned[_index([i for i, _ in limited], device)] = True
    if token_ids:
        banned[_index(row_ids, device), _index(token_ids, device)] = False
    logits.masked_fill_(banned, float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Ban EOS and stop token ids for rows that have not yet generated min_tokens tokens."""
    vocab = logits.shape[-1]
    banned = [(i, token) for i, row in enumerate(rows)
              if len(row.output_token_ids) < row.params.min_tokens
              for token in (*row.eos_token_ids, *row.params.stop_token_ids)
              if 0 <= token < vocab]
    if banned:
        row_ids, token_ids = tensor_on(banned, logits.device).T
        logits[row_ids, token_ids] = float("-inf")


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, filters, then the exponential race; returns one token id per row."""
    device = logits.device
    # Past MAX_TEMPERATURE every kept token is equally likely anyway; a float32 inf (1e39)
    # would turn the -inf of banned tokens into NaN.
    temperature = _column([min(row.params.temperature, MAX_TEMPERATURE) for row in rows], device)
    logits = logits / temperature
    keep = _keep_mask(logits, rows)
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    noise = torch.stack([_exponential_noise(row, logits.shape[-1], device) for row in rows])
    return (probs / noise).argmax(dim=-1)


def _keep_mask(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Tokens surviving top-k, then top-p, then min-p, for all rows at once with one sort."""
    device, vocab = logits.device, logits.shape[-1]
    params = [row.params for row in rows]
    sorted_logits, order = logits.sort(dim=-1, descending=True)

    # A top_k past the vocabulary keeps everything (and must not overflow the int64 column).
    top_k = _column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device,
                    torch.long)
    keep = torch.arange(vocab, device=device) < top_k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)

    # Nucleus: keep a token while the mass ranked strictly above it is < top_p, which is the
    # smallest prefix reaching top_p and always includes the top token. top_p == 1 is skipped
    # so that float32 rounding in the cumsum can never drop tail tokens.
    top_p = _column([p.top_p for p in params], device)
    mass_above = probs.cumsum(dim=-1) - probs
    keep &= (mass_above < top_p) | (top_p >= 1.0)
    keep[:, 0] = True  # even when top_p rounds to 0 in float32 (a top_p of 1e-46)

    # min-p compares with the top token; the earlier filters rescale both sides equally.
    min_p = _column([p.min_p for p in params], device)
    keep &= probs >= min_p * probs[:, :1]
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _exponential_noise(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(noise_seed(row.seed, row.step))
    noise = torch.empty(vocab, dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    # A zero draw would turn probs / noise into inf or nan; clamping changes nothing measurable.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _fill_logprobs(out: list[TokenLogprobs | None], raw_logprobs: torch.Tensor,
                   tokens: torch.Tensor, rows: Sequence[SamplingRow],
                   logprob_rows: list[int]) -> None:
    """Sampled-token logprob, its rank and the top-N list, all from the raw distribution."""
    chosen = tokens[_index(logprob_rows, tokens.device)]
    # logprob_rows holds only the rows that asked for logprobs: none of them is None.
    counts = [rows[i].params.logprobs or 0 for i in logprob_rows]
    entries = _entries(raw_logprobs, chosen, max(counts))
    for entry, i, n in zip(entries, logprob_rows, counts):
        out[i] = entry if len(entry.top) <= n else TokenLogprobs(
            entry.token_id, entry.logprob, entry.rank, entry.top[:n])


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int],
                 num_top: int) -> list[TokenLogprobs]:
    """Row i's logprob of token_ids[i], its rank and the num_top most likely tokens, from the
    raw distribution: a prompt token's entry given the tokens before it (prompt_logprobs)."""
    raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return _entries(raw_logprobs, tensor_on(list(token_ids), logits.device), num_top)


def _entries(raw_logprobs: torch.Tensor, chosen: torch.Tensor,
             widest: int) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob, its rank, and the `widest` top tokens."""
    chosen = chosen.unsqueeze(-1)
    chosen_logprob = raw_logprobs.gather(-1, chosen)
    # Rank 1 + the number of strictly more likely tokens: the argmax is always rank 1.
    ranks = (raw_logprobs > chosen_logprob).sum(dim=-1) + 1
    top_values, top_ids = raw_logprobs.topk(min(widest, raw_logprobs.shape[-1]), dim=-1)
    rows = zip(chosen.squeeze(-1).tolist(), chosen_logprob.squeeze(-1).tolist(),
               ranks.tolist(), top_ids.tolist(), top_values.tolist())
    return [TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids, values)))
            for t, lp, r, ids, values in rows]
