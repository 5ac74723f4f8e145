"""Continuous batching with one token budget per step.

Each step: running requests first (decodes, then the next chunk of any prefill in progress,
which leaves room for the head of the queue), then waiting requests in arrival order, with
prefix-cache hits skipping their computed pages. A step that decodes carries at most
`prefill_beside_decodes` prefill tokens (where the backend or the config sets it), so a long
prompt does not hold the running requests' next tokens for a whole large chunk. So a new request
starts prefilling in the step after it arrives, whatever else the rank is doing.
When blocks run out, the newest running request is preempted and recomputed later; preempted
requests go back to the head of the queue, so nothing starves. With HiCache, admission also
loads host pages that continue the device hit, and every finished prefill writes its prompt
pages through to the host.
"""
from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from deepinfer.core.batch import (
    GroupBatch,
    InputsFromLastStep,
    ModelBatch,
    PromptLogprobRows,
    SampledRow,
    SamplerOutput,
    SamplingRow,
    SpecBatch,
    TokenLogprobs,
)
from deepinfer.core.config import SchedulerConfig
from deepinfer.core.hicache import HiCache
from deepinfer.core.kv.manager import KVCacheManager
from deepinfer.core.padding import Buckets, pad_batch
from deepinfer.core.request import FinishReason, Request, RequestStatus
from deepinfer.core.speculative import SpecDecodeStats


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # drafts included
    sampled: bool
    num_drafts: int = 0  # speculative decoding: drafts at the end of the query, to verify


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass(frozen=True)
class TokenUpdate:
    """What one step produced for one request."""

    request: Request
    # [] for a prefill chunk that sampled nothing; several with accepted drafts, cut after a
    # stop token or at max_tokens
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 hicache: HiCache | None = None, buckets: Buckets = Buckets(),
                 fixed_pool: bool = False) -> None:
        self.config = config
        self.num_spec = config.num_speculative_tokens
        self.spec_stats = SpecDecodeStats(self.num_spec)
        self.kv = kv
        self.hicache = hicache
        self.max_model_len = max_model_len
        self.buckets = buckets
        # A fixed pool admits a request only with room for all it may ever hold: no preemption.
        self.fixed_pool = fixed_pool
        self.max_num_seqs = buckets.max_seqs(config.step_seqs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if self.hicache is not None and self.hicache.disk is not None:
            # Its pages on disk start for the host tier now (the device lookup only then: no
            # second prefix walk per request without a disk tier).
            self.hicache.prefetch(req, len(self.kv.find_cached_prefix(req)[0]))

    def finish(self, req: Request, reason: FinishReason,
               stop_reason: str | int | None = None) -> None:
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        if self.hicache is not None:
            self.hicache.forget(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop_reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.buckets.token_budget(self.config.step_tokens)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        cap = self.config.long_prefill_token_threshold
        if cap > 0:
            remaining = min(remaining, cap)
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0
        return min(remaining, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first: a prefill in progress never holds back a decoding request's token.
        # Prefill chunks then leave a reserve for the waiting queue's head, so a new request
        # starts its prefill in this very step instead of after a long prefill finishes
        # (prefill-any-interval). The reserve is at most half of what the decodes left, so
        # the prefill in progress keeps moving however many requests arrive.
        scheduled: set[int] = set()
        decodes = [r for r in self.running if self._is_decode(r)]
        prefills = [r for r in self.running if not self._is_decode(r)]
        budget = self._schedule_group(decodes, out, budget, scheduled)
        cap = self.config.prefill_beside_decodes or 0
        if out.seqs and cap > 0:  # decodes ride in this step: prefills (and admissions) share
            budget = min(budget, cap)  # at most `cap` tokens, so the step stays short
        keep = min(self._admission_reserve(), budget // 2) if prefills else 0
        return self._schedule_group(prefills, out, budget - keep, scheduled) + keep

    @staticmethod
    def _is_decode(req: Request) -> bool:
        return req.num_tokens - req.num_computed_tokens <= 1

    def _admission_reserve(self) -> int:
        """Budget that prefills in progress leave for the waiting head (an upper bound: its
        prefix hits are only known at admission)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return 0
        return self.waiting[0].num_tokens

    def _schedule_group(self, reqs: list[Request], out: SchedulerOutput, budget: int,
                        scheduled: set[int]) -> int:
        for req in reqs:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room
            if req.num_pending and self._ends_by_length(req):
                continue  # its token in flight is its last, whatever it is
            num_new = self._chunk(req, budget)
            if num_new == 0:
                continue
            sampled = self._will_sample(req, num_new)
            drafts = self._num_drafts(req, budget - num_new) if sampled else 0
            ahead = self._lookahead(req, req.num_computed_tokens + num_new + drafts, sampled)
            self.kv.free_out_of_window(req)
            while not self._allocate(req, num_new + drafts + ahead):
                victim = self.running[-1]
                if id(victim) in scheduled:
                    # Never preempt work already placed in this step's batch.
                    victim = req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.seqs.append(ScheduledSeq(req, num_new + drafts, sampled, drafts))
                scheduled.add(id(req))
                budget -= num_new + drafts
        return budget

    def _allocate(self, req: Request, num_new_tokens: int,
                  cached: list | None = None, loaded_pages: int = 0) -> bool:
        """kv.allocate; when the pool is short while write-through stores hold blocks, those
        stores are waited out first (they end on their own within milliseconds, where a
        preemption or a stalled admission costs a recompute)."""
        if self.kv.allocate(req, num_new_tokens, cached, loaded_pages):
            return True
        if self.hicache is None or not self.hicache.holds_blocks:
            return False
        self.hicache.poll(wait=True)
        return self.kv.allocate(req, num_new_tokens, cached, loaded_pages)

    def _speculates(self, req: Request) -> bool:
        # A grammar's matcher cannot take back tokens, so constrained requests decode plainly.
        return self.num_spec > 0 and req.params.structured is None

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Drafts verified this step: what the last step proposed, within the budget, the
        context length and max_tokens (a step gives at most drafts + 1 tokens)."""
        room = min(budget, self.max_model_len - req.num_tokens - 1,
                   req.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(len(req.draft_token_ids), room))

    def _lookahead(self, req: Request, end: int, sampled: bool) -> int:
        """Slots past the query for the draft layer's own proposals: proposal j is computed
        at the position of the last accepted token + j - 1."""
        if not sampled or not self._speculates(req):
            return 0
        most = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        return max(0, min(self.num_spec - 1, most - end))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = req.num_computed_in_flight = 0
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.hicache is not None and self.hicache.prefetching(req):
                if self.running or out.seqs:
                    break  # the steps go on; it is admitted once its pages are read
                self.hicache.wait_prefetch(req)
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached[0])
            device_tokens = num_cached * self.kv.block_size
            host = self.hicache.match(req, num_cached) if self.hicache is not None else None
            host_tokens = host.num_tokens if host is not None else 0
            hit_tokens = device_tokens + host_tokens
            req.num_computed_tokens = 0
            remaining = req.num_tokens - hit_tokens
            num_new = min(remaining, budget)
            if self.config.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            # Host-hit pages need device blocks too: allocated here with the first chunk's.
            loaded = len(host.pages) if host is not None else 0
            sampled = hit_tokens + num_new == req.num_tokens
            ahead = self._lookahead(req, hit_tokens + num_new, sampled)
            if ((not self.config.enable_chunked_prefill and remaining > budget)
                    or (self.fixed_pool and not self._fits_whole(req, hit_tokens, cached))
                    or not self._allocate(req, host_tokens + num_new + ahead, cached, loaded)):
                if host is not None and self.hicache is not None:
                    self.hicache.release(host)  # its pins: the request waits
                break
            self.waiting.popleft()
            if host is not None and self.hicache is not None:
                end = num_cached + len(host.pages)
                self.hicache.load(req, host, [ids[num_cached:end] for ids in
                                              self.kv.group_block_ids(req.request_id)])
            if req.num_cached_tokens < 0:  # its first admission
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = hit_tokens
                self.kv.record_lookup(req.num_tokens, device_tokens)
                if self.hicache is not None and req.reads_prefix_cache:
                    self.hicache.record_lookup(device_tokens, host_tokens)
            req.num_computed_tokens = hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_new, self._will_sample(req, num_new)))
            budget -= num_new

    def _fits_whole(self, req: Request, hit_tokens: int, cached) -> bool:
        """Room for every block the request may hold, minus what running requests may still
        claim of theirs (a fixed pool is never outgrown, so nothing is ever preempted)."""
        most = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        need = self.kv.blocks_needed(req, most - hit_tokens, cached)
        reserved = sum(self._still_to_claim(r) for r in self.running)
        return self.kv.can_allocate(need + reserved)

    def _still_to_claim(self, req: Request) -> int:
        most = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        return max(0, self.kv.blocks_needed(req, most - req.num_computed_tokens))

    def _ends_by_length(self, req: Request) -> bool:
        n_out = len(req.output_token_ids) + req.num_pending
        return n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len

    @staticmethod
    def _will_sample(req: Request, num_new: int) -> bool:
        return req.num_computed_tokens + num_new == req.num_tokens

    # ---- the batch a backend sees --------------------------------------------------------
    def build_batch(self, out: SchedulerOutput,
                    in_flight: tuple[SchedulerOutput, Any] | None = None) -> ModelBatch:
        """The step's batch. in_flight: the step launched and not read yet, with its StepFuture
        (async scheduling); a decode whose input token that step samples reads it there."""
        bs = self.kv.block_size
        last_rows = _sampled_rows(in_flight[0]) if in_flight is not None else {}
        pending_at: list[int] = []
        pending_rows: list[int] = []
        num_groups = len(self.kv.groups)
        ids: list[int] = []
        positions: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_indices: list[int] = []
        rows: list[SamplingRow] = []
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        state_slots: list[int] = []
        scored: list[PromptLogprobRows] = []
        for i, seq in enumerate(out.seqs):
            req, start = seq.request, seq.request.num_computed_tokens
            end = start + seq.num_new_tokens
            rid = req.request_id
            if end - start == 1 and start >= req.num_known_tokens:  # sampled by the step in flight
                pending_at.append(len(ids))
                pending_rows.append(last_rows[id(req)])
                ids.append(0)
                positions.append(start)
            elif end - start == 1:  # decodes: most rows of a busy step
                ids.append(req.token_at(start))
                positions.append(start)
            elif seq.num_drafts:  # a decode whose drafts are verified in the same forward
                ids.extend([req.token_at(start), *req.draft_token_ids[:seq.num_drafts]])
                positions.extend(range(start, end))
            else:
                ids.extend(req.token_slice(start, end))
                positions.extend(range(start, end))
            for g in range(num_groups):
                table = self.kv.block_ids(rid, g)
                tables[g].append(table)
                if end - start == 1:
                    slots[g].append(table[start // bs] * bs + start % bs)
                else:
                    slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            slot = self.kv.state_slot(rid)
            if slot is not None:
                state_slots.append(slot)
            positions_scored = scored_prompt_positions(req, seq.num_new_tokens)
            if positions_scored:
                scored.append(PromptLogprobRows(
                    i, positions_scored.start - start,
                    req.prompt_token_ids[positions_scored.start + 1:positions_scored.stop + 1],
                    req.params.prompt_logprobs or 0))
            qlens.append(seq.num_new_tokens)
            slens.append(end)
            if seq.sampled:
                sample_indices.append(i)
                rows.append(SamplingRow(req.params, req.seed,
                                        len(req.output_token_ids) + req.num_pending,
                                        req.prompt_token_ids, req.output_token_ids,
                                        req.eos_token_ids))
        from_last = InputsFromLastStep(pending_at, pending_rows, in_flight[1]) \
            if pending_at and in_flight is not None else None
        batch = ModelBatch(ids, positions, qlens, slens,
                           tuple(GroupBatch(t, s) for t, s in zip(tables, slots)),
                           sample_indices, rows, state_slots, spec=self._spec_batch(out),
                           from_last_step=from_last, prompt_logprobs=scored)
        return pad_batch(batch, self.buckets, self.kv.block_size)

    def _spec_batch(self, out: SchedulerOutput) -> SpecBatch | None:
        if not self.num_spec:
            return None
        sampled = [s for s in out.seqs if s.sampled]
        return SpecBatch(
            [s.request.draft_token_ids[:s.num_drafts] for s in sampled],
            [self.num_spec if self._speculates(s.request) else 0 for s in sampled],
            [-1 if s.sampled else s.request.token_at(s.request.num_computed_tokens +
                                                     s.num_new_tokens) for s in out.seqs])

    # ---- results back --------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[TokenUpdate]:
        """A step run to the end: advance() and resolve() at once."""
        self.advance(out)
        return self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """Right after a step is launched: its query's tokens count as computed (drafts are
        counted once verified) and each sampled row holds one token in flight. The next
        step can be scheduled from here, before this one's tokens are known."""
        for seq in out.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # ended while the step ahead was read: nothing of this one is kept
            req.num_computed_in_flight = seq.num_new_tokens - seq.num_drafts
            req.num_computed_tokens += req.num_computed_in_flight
            if seq.sampled:
                req.num_pending += 1

    def resolve(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[TokenUpdate]:
        """An advanced step's tokens are back: each request takes its own, up to a stop.
        Requests that ended since the step was launched take none."""
        rows = iter(sampled.rows())
        updates = []
        for i, seq in enumerate(out.seqs):
            row = next(rows) if seq.sampled else SampledRow([], [])
            if seq.request.is_finished:
                continue
            seq.request.prompt_logprobs.extend(sampled.prompt_logprobs.get(i, ()))
            updates.append(self._update_seq(seq, row))
        return updates

    def _update_seq(self, seq: ScheduledSeq, row: SampledRow) -> TokenUpdate:
        req = seq.request
        req.num_computed_in_flight = 0
        if seq.sampled:
            req.num_pending -= 1
        n, stop = self._tokens_until_stop(req, row.token_ids)
        req.output_token_ids.extend(row.token_ids[:n])
        if n:
            first = req.first_token_time is None
            req.took_tokens(time.monotonic())
            if first and self.hicache is not None:
                self.hicache.record_prefill(req)
        if req.status is not RequestStatus.RUNNING:
            # Preempted while its token was in flight: the token stands (it was computed
            # from the whole context); the recompute starts from scratch anyway.
            if stop is not None:
                self.finish(req, *stop)
            return TokenUpdate(req, row.token_ids[:n], row.logprobs[:n], req.is_finished)
        before = req.num_computed_tokens - (seq.num_new_tokens - seq.num_drafts)
        # Computed now: the query's tokens up to the last accepted draft (the newest token,
        # sampled or the model's own after the drafts, is computed by the next step).
        req.num_computed_tokens += max(0, n - 1)
        self.kv.cache_computed_pages(req)
        if self.hicache is not None and before < req.num_prompt_tokens:
            # Write-through of each prefill chunk's full pages as they are computed, so the
            # prompt's store ends soon after the prompt does (a host-tier hit on a pool that
            # needs those blocks waits for it); the store holds the blocks it reads until its
            # copy is done, however the request ends.
            self.hicache.store(req, self.kv.group_block_ids(req.request_id),
                               hold=functools.partial(self.kv.hold, req.request_id),
                               upto=req.num_computed_tokens)
        if seq.sampled:
            self.spec_stats.record(seq.num_drafts, len(row.token_ids) - 1)
            req.draft_token_ids = row.proposals
        if stop is not None:
            self.finish(req, *stop)
        return TokenUpdate(req, row.token_ids[:n], row.logprobs[:n], req.is_finished)

    def _tokens_until_stop(self, req: Request, tokens: list[int]
                           ) -> tuple[int, tuple[FinishReason, int | None] | None]:
        """How many new tokens the request takes: all, or up to the first that ends it (never
        a token past a stop, however many drafts were accepted after it)."""
        n_out = len(req.output_token_ids)
        for i, token in enumerate(tokens):
            stop = self._stop(req, token, n_out + i + 1)
            if stop is not None:
                return i + 1, stop
        return len(tokens), None

    def _stop(self, req: Request, token: int, n_out: int
              ) -> tuple[FinishReason, int | None] | None:
        """Whether the request ends at `token`, its n_out-th output token."""
        params = req.params
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP, token
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None


def scored_prompt_positions(req: Request, num_new_tokens: int) -> range:
    """The positions whose prompt logprobs the request's next num_new_tokens score: the
    logits at position p give prompt token p + 1's entry, up to the last prompt token's (its
    logits sample the first output token); positions scored before are not scored again."""
    if req.params.prompt_logprobs is None:
        return range(0)
    start = req.num_computed_tokens
    return range(max(start, len(req.prompt_logprobs)),
                 min(start + num_new_tokens, req.num_prompt_tokens - 1))


def _sampled_rows(out: SchedulerOutput) -> dict[int, int]:
    """id(request) -> its row among a step's sampled rows."""
    return {id(seq.request): i for i, seq in enumerate(s for s in out.seqs if s.sampled)}
