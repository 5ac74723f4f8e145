"""The engine: add_request / step / abort. One per rank process.

    step():  schedule -> accelerator.execute(batch) -> scheduler.update -> detokenize

With async scheduling a step is launched before the one ahead is read:

    step():  schedule -> accelerator.launch(batch) -> read the step ahead -> advance
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import random
from dataclasses import dataclass
from typing import Any, Sequence

from deepinfer.core.accelerator import Accelerator, Capabilities, ParallelContext, StepFuture
from deepinfer.core.batch import TokenLogprobs
from deepinfer.core.config import EngineConfig
from deepinfer.core.detokenizer import IncrementalDetokenizer
from deepinfer.core.hicache import HiCache
from deepinfer.core.hicache.disk import kv_fingerprint
from deepinfer.core.hicache.shared_pool import SharedPoolPlace
from deepinfer.core.histogram import STEP_TOKEN_BOUNDS, CountHistogram
from deepinfer.core.kv.manager import KVCacheManager
from deepinfer.core.outputs import RequestOutput
from deepinfer.core.padding import Buckets, dummy_batch
from deepinfer.core.request import FinishReason, Request
from deepinfer.core.sampling import SamplingParams
from deepinfer.core.scheduler import (
    Scheduler,
    SchedulerOutput,
    TokenUpdate,
    scored_prompt_positions,
)
from deepinfer.core.step_faults import isolate
from deepinfer.core.structured import GrammarCompiler, RequestGrammar

log = logging.getLogger("deepinfer.engine")
# Steps in a row in which every sequence failed on its own: the device, not a request, is
# broken, and the rank should die (and be restarted) rather than fail every request forever.
MAX_BROKEN_STEPS = 3


class EngineDeadError(RuntimeError):
    """Every request of several steps in a row failed: the engine cannot serve."""


@dataclass
class _Sample:
    """One of a request's n samples, with its streaming text state."""

    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None
    grammar: RequestGrammar | None = None
    text: str = ""
    prompt_logprobs_sent: bool = False  # they go out once, with the sample's first tokens


class Engine:
    def __init__(self, config: EngineConfig, accelerator: Accelerator | None = None,
                 tokenizer: Any = None, load_tokenizer: bool = True,
                 parallel: ParallelContext = ParallelContext(),
                 shared_host_pool: SharedPoolPlace | None = None) -> None:
        self.accelerator = accelerator or _select_accelerator(config)
        self.config = config = with_step_limits(config, self.accelerator.capabilities)
        self.tokenizer = tokenizer if tokenizer is not None or not load_tokenizer \
            else load_hf_tokenizer(config.model.path, config.model.trust_remote_code)
        self.accelerator.init_device(parallel)
        self.accelerator.configure(config)
        _check_speculative(config, self.accelerator)
        self.model = self.accelerator.load_model(config.model)
        # Read after the load: a static-shape backend plans its buckets from the model.
        caps = self.accelerator.capabilities
        self.max_model_len = self.model.max_model_len
        num_blocks = self.accelerator.num_kv_blocks(config.cache)
        # Every sequence that can run at once holds one state slot (models with state only).
        num_slots = config.scheduler.step_seqs if self.model.kv_spec.state_bytes else 0
        self.accelerator.allocate_kv_cache(num_blocks, config.cache.block_size, num_slots)
        self.accelerator.warm_up()
        self.accelerator.capture_graphs()
        self.kv = KVCacheManager(num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, self.model.kv_spec,
                                 num_slots)
        self.hicache = HiCache.create(
            self.accelerator, config.cache, self.model.kv_spec,
            functools.partial(kv_fingerprint, config.model, config.seed, self.accelerator.name,
                              block_size=config.cache.block_size), shared_host_pool)
        scheduler_config = config.scheduler
        if not caps.chunked_prefill and scheduler_config.enable_chunked_prefill:
            scheduler_config = dataclasses.replace(scheduler_config, enable_chunked_prefill=False)
        if scheduler_config.prefill_beside_decodes is None:
            scheduler_config = dataclasses.replace(
                scheduler_config, prefill_beside_decodes=caps.prefill_beside_decodes)
        buckets = Buckets(caps.token_buckets, caps.batch_buckets)
        self.scheduler = Scheduler(scheduler_config, self.kv, self.max_model_len, self.hicache,
                                   buckets, caps.fixed_kv_pool)
        self._samples: dict[str, _Sample] = {}  # child request id -> sample
        self._children: dict[str, list[str]] = {}  # request id -> child ids
        self._rng = random.Random(config.seed)
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._broken_steps = 0
        self.num_dummy_steps = 0
        self.step_tokens = CountHistogram(STEP_TOKEN_BOUNDS)  # tokens computed per real step
        self.last_step_prefilled = False
        # Async scheduling: not under expert parallel (ranks agree on each step's shape before
        # it runs) nor with drafts (the next step's drafts come from this one's results).
        self._async = (scheduler_config.async_scheduling and caps.async_output and
                       not scheduler_config.num_speculative_tokens and
                       not self.model.needs_collectives)
        self._in_flight: tuple[SchedulerOutput, StepFuture] | None = None
        self.num_overlapped_steps = 0  # steps launched while the one ahead still ran
        self.num_sync_fallbacks = 0  # async launches that raised and ran synchronously

    # ---- requests ------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def token_limit(self) -> int:
        """Most tokens one sequence can hold: the context length, or the whole KV pool (a
        sliding-window model holds only its windows, so the pool does not bound it)."""
        window = max(g.sliding_window or 0 for g in self.model.kv_spec.groups)
        budget = self.config.scheduler.step_tokens
        if self.kv.all_sliding and \
                (window + budget) // self.kv.block_size + 2 <= self.kv.pool.num_usable:
            return self.max_model_len
        return min(self.max_model_len, self.kv.pool.num_usable * self.kv.block_size)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    prefix_cache: bool = True, grammar: Any = None) -> None:
        """`grammar`: the constraint's grammar, compiled already (a rank prepares it off its
        step loop); without one a constrained request's grammar is compiled here."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if params.prompt_logprobs is not None and \
                not self.accelerator.capabilities.prompt_logprobs:
            raise ValueError(f"the {self.accelerator.name} backend does not compute "
                             f"prompt_logprobs")
        prompt_ids = self._prompt_ids(prompt)
        self._check_token_fields(params)
        limit = self.token_limit()
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; this model's context "
                             f"length is {limit} tokens, leaving no room to generate")
        step_tokens = self.scheduler.buckets.token_budget(
            self.scheduler.config.step_tokens)
        if not self.scheduler.config.enable_chunked_prefill and len(prompt_ids) > step_tokens:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; without chunked prefill "
                             f"one step holds at most {step_tokens}")
        max_tokens = min(params.max_tokens or limit, limit - len(prompt_ids))
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        grammars = [self._grammar(params, grammar) for _ in range(params.n)]
        children: list[str] = []
        self._children[request_id] = children  # first, so abort() can undo a partial add
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, prompt_ids, params, seed=base_seed + i, max_tokens=max_tokens,
                          eos_token_ids=self.eos_token_ids, use_prefix_cache=prefix_cache)
            detok = None if self.tokenizer is None else \
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            self._samples[child_id] = _Sample(req, request_id, i, detok, grammars[i])
            self.scheduler.add(req)
            children.append(child_id)

    def _grammar(self, params: SamplingParams, compiled: Any = None) -> RequestGrammar | None:
        if params.structured is None:
            return None
        compiler = self.grammar_compiler()
        if compiled is not None:
            return compiler.matcher_of(compiled)
        return compiler.matcher(params.structured)

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The grammar compiler, if a constrained request built it."""
        return self._grammars

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of this engine's tokenizer (built on the first constrained request)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size,
                                             self.eos_token_ids)
        return self._grammars

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            # Python ints (what the server sends) are copied as they are: the C loops here and
            # in min/max below check a long prompt's ids without a Python loop per element.
            ids = list(prompt) if set(map(type, prompt)) <= {int} else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def _check_token_fields(self, params: SamplingParams) -> None:
        """logit_bias and allowed_token_ids name tokens of this model (SamplingParams checked
        that they are non-negative ints)."""
        vocab = self.model.vocab_size
        for name, ids in (("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids)):
            if ids and max(ids) >= vocab:
                raise ValueError(f"{name} holds token ids out of range [0, {vocab}): "
                                 f"{sorted(t for t in ids if t >= vocab)[:5]}")

    def abort(self, request_id: str) -> None:
        self._end(request_id, FinishReason.ABORT)

    def _end(self, request_id: str, reason: FinishReason) -> None:
        # Samples that finished already were forgotten; their siblings may still run.
        for child_id in self._children.pop(request_id, []):
            sample = self._samples.pop(child_id, None)
            if sample is not None:
                self.scheduler.finish(sample.request, reason)

    def has_unfinished_requests(self) -> bool:
        # A step in flight needs no call of its own: its live requests are still unfinished,
        # and one whose requests all ended has nothing left to give (the next step reads it).
        return self.scheduler.num_unfinished > 0

    @property
    def has_background_work(self) -> bool:
        """Host copies or disk jobs in flight that only `poll_caches` (or a step) finishes."""
        return self.hicache is not None and self.hicache.busy

    def poll_caches(self) -> None:
        """Finish the cache tiers' copies and disk jobs that are done, while no step runs (a
        step polls them itself): stored pages get indexed, their host pages unpinned."""
        if self.hicache is not None:
            self.hicache.poll()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.hicache is not None:
            self.hicache.poll()  # finished host copies: index stored pages, unpin
        scheduled = self.scheduler.schedule()
        # A step that runs a prompt chunk (EPLB's --eplb-after-prefill rebalances after one).
        self.last_step_prefilled = any(s.num_new_tokens > 1 for s in scheduled.seqs)
        if scheduled.seqs and self._overlaps(scheduled):
            return self._launch(scheduled)
        return self._read_then_run(scheduled)

    def _read_then_run(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """The step in flight's outputs, then this step run to the end without the requests
        that step ended."""
        done = self._read_in_flight()
        scheduled.seqs = [s for s in scheduled.seqs if not s.request.is_finished]
        if not scheduled.seqs:
            if self.model.needs_collectives:
                self.dummy_step()  # nothing fits this step, but the peers' layers need ours
            return done
        return done + self._run(scheduled)

    def _run(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """One step run to the end: execute, then every request takes its tokens."""
        failed: list[RequestOutput] = []
        self.step_tokens.observe(scheduled.num_tokens)
        try:
            sampled = self._execute(scheduled)
            self._broken_steps = 0
        except Exception:  # noqa: BLE001 - narrowed down to the requests that cause it
            if self.model.needs_collectives:
                raise  # re-running parts on one rank alone would leave its peers' collectives
            scheduled, sampled = self._isolate_fault(scheduled, failed)
        updates = self.scheduler.update(scheduled, sampled)
        return failed + [out for u in updates if (out := self._safe_output(u, failed))]

    # ---- async scheduling ----------------------------------------------------------------
    def _overlaps(self, scheduled: SchedulerOutput) -> bool:
        """Whether this step may run while the one ahead is unread: each sampled row needs
        nothing of its request's newest token on the host (penalties count it, grammars
        advance on it, min_tokens may still ban EOS) and gives back token ids only; no
        sequence scores prompt positions (their entries come back with the step's output)."""
        if not self._async:
            return False
        return all(_needs_ids_only(s.request) for s in scheduled.seqs if s.sampled) and \
            not any(scored_prompt_positions(s.request, s.num_new_tokens) for s in scheduled.seqs)

    def _launch(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Launch this step, then read the one ahead while it runs: the outputs returned are
        that step's; this one's come with the next call."""
        batch = self.scheduler.build_batch(scheduled, self._in_flight)
        try:
            future = self.accelerator.launch(batch)
        except Exception as exc:  # noqa: BLE001 - the synchronous path isolates the fault
            log.warning("async launch failed (%s: %s); the step runs synchronously",
                        type(exc).__name__, exc)
            self.num_sync_fallbacks += 1
            return self._read_then_run(scheduled)
        self.num_overlapped_steps += self._in_flight is not None
        self.step_tokens.observe(scheduled.num_tokens)
        done = self._read_in_flight()
        self.scheduler.advance(scheduled)
        self._in_flight = (scheduled, future)
        return done

    def _read_in_flight(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and turn its tokens into outputs."""
        if self._in_flight is None:
            return []
        scheduled, future = self._in_flight
        self._in_flight = None
        updates = self.scheduler.resolve(scheduled, future.result())
        failed: list[RequestOutput] = []
        outputs = [out for u in updates if (out := self._safe_output(u, failed))]
        return failed + outputs

    def dummy_step(self) -> None:
        """A step of no real work, for a rank whose peers step (their collectives must be
        matched): one padding token in the null block, nothing sampled."""
        self.accelerator.execute(dummy_batch(len(self.kv.groups), self.kv.block_size))
        self.num_dummy_steps += 1

    def rebalance_experts(self):
        """EPLB, collective: every rank of the expert-parallel group calls it at the same
        iteration. Returns the backend's report (stall, imbalance before and after)."""
        return self.accelerator.rebalance_experts()

    def _execute(self, scheduled: SchedulerOutput):
        return self.accelerator.execute(self._constrain(scheduled))

    def _isolate_fault(self, scheduled: SchedulerOutput, failed: list[RequestOutput]):
        """Re-run the step in parts; fail only the requests that fail alone."""
        parts = isolate(self._execute, scheduled.seqs)
        for seq, exc in parts.failed:
            failed.extend(self._fail(seq.request.request_id, exc))
        self._broken_steps = self._broken_steps + 1 if not parts.seqs else 0
        if self._broken_steps >= MAX_BROKEN_STEPS:
            raise EngineDeadError(f"every request of {MAX_BROKEN_STEPS} steps in a row failed")
        out, sampled = parts.survivors(lambda s: not s.request.is_finished)
        out.preempted = scheduled.preempted
        return out, sampled

    def _safe_output(self, update: TokenUpdate, failed: list[RequestOutput]
                     ) -> RequestOutput | None:
        if update.request.request_id not in self._samples:
            return None  # failed in this step after its update (a sibling's fault)
        try:
            return self._output(update)
        except Exception as exc:  # noqa: BLE001 - a detokenizer or grammar fault
            failed.extend(self._fail(update.request.request_id, exc))
            return None

    def _fail(self, child_id: str, exc: BaseException) -> list[RequestOutput]:
        """End the request `child_id` belongs to (all its samples) with an error output."""
        sample = self._samples.get(child_id)
        if sample is None:
            return []  # a sibling failed first
        log.error("request %s failed in the engine; its batch goes on", sample.parent_id,
                  exc_info=exc)
        self._end(sample.parent_id, FinishReason.ERROR)
        req = sample.request
        return [RequestOutput(sample.parent_id, sample.index, req.prompt_token_ids, [], "",
                              list(req.output_token_ids), sample.text, finished=True,
                              finish_reason=FinishReason.ERROR.value,
                              error=f"internal error while generating: "
                                    f"{type(exc).__name__}: {exc}")]

    def _constrain(self, scheduled: SchedulerOutput):
        """The step's batch, with allowed-token bitmasks on rows under a grammar."""
        batch = self.scheduler.build_batch(scheduled)
        if self._grammars is None:
            return batch
        rows = list(batch.sampling)
        for k, i in enumerate(batch.sample_indices):
            grammar = self._samples[scheduled.seqs[i].request.request_id].grammar
            if grammar is not None:
                rows[k] = dataclasses.replace(rows[k], token_bitmask=grammar.next_bitmask())
        return dataclasses.replace(batch, sampling=rows)

    def _output(self, update: TokenUpdate) -> RequestOutput | None:
        if not update.token_ids:
            return None
        req = update.request
        sample = self._samples[req.request_id]
        new_text, kept, stop = "", 0, None
        for token in update.token_ids:
            text, stop = self._add_token(sample, token)
            new_text, kept = new_text + text, kept + 1
            if stop is not None:
                self._end_at(req, stop, cut=kept < len(update.token_ids))
                break
        # A stop string inside a run of accepted drafts: nothing after it is output.
        del req.output_token_ids[len(req.output_token_ids) - len(update.token_ids) + kept:]
        if sample.detok is not None:
            if req.is_finished:
                new_text += sample.detok.flush()
            sample.text += new_text
        if req.is_finished:
            self._forget(sample)
        return RequestOutput(
            request_id=sample.parent_id, index=sample.index,
            prompt_token_ids=req.prompt_token_ids, new_token_ids=update.token_ids[:kept],
            new_text=new_text, token_ids=req.output_token_ids, text=sample.text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            new_logprobs=[lp for lp in update.logprobs[:kept] if lp is not None],
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=self._prompt_logprobs(sample),
            times=req.times() if req.is_finished else None)

    @staticmethod
    def _prompt_logprobs(sample: _Sample) -> list[TokenLogprobs | None] | None:
        """The prompt's entries (None for the first token, which nothing precedes), on the
        sample's first output only."""
        req = sample.request
        if req.params.prompt_logprobs is None or sample.prompt_logprobs_sent:
            return None
        sample.prompt_logprobs_sent = True
        return [None, *req.prompt_logprobs]

    def _add_token(self, sample: _Sample, token: int
                   ) -> tuple[str, tuple[FinishReason, str | None] | None]:
        """One new token through the request's grammar and detokenizer: its new text, and the
        stop it makes (a complete grammar, a stop string), if any."""
        stop: tuple[FinishReason, str | None] | None = None
        if sample.grammar is not None and not sample.request.is_finished:
            # The grammar is complete once it accepts a stop token; nothing may follow.
            if not sample.grammar.accept(token) or sample.grammar.terminated:
                stop = (FinishReason.STOP, None)
        if sample.detok is None:
            return "", stop
        new_text = sample.detok.add_token(token) or ""
        if sample.detok.stopped_by is not None and stop is None:
            stop = (FinishReason.STOP, sample.detok.stopped_by)
        return new_text, stop

    def _end_at(self, req: Request, stop: tuple[FinishReason, str | None], cut: bool) -> None:
        """Finish at a stop the engine found. The scheduler's own stop (EOS, max_tokens) at
        the same token stands; one at a later token of the run gives way to this earlier one."""
        if not req.is_finished:
            self.scheduler.finish(req, *stop)
        elif cut:
            req.finish_reason, req.stop_reason = stop

    def _forget(self, sample: _Sample) -> None:
        self._samples.pop(sample.request.request_id, None)
        siblings = self._children.get(sample.parent_id, [])
        if all(c not in self._samples for c in siblings):
            self._children.pop(sample.parent_id, None)

    def rejoin_group(self, parallel: ParallelContext) -> list[str]:
        """Expert parallel, a peer rank was lost and replaced: every request ends (the API
        process failed them when the peer died; their step broke off), the device's cached
        pages go (a backend may run start-up steps over the pool again to match the new
        rank's, see Accelerator.rebind_group), and the accelerator takes the new group. The
        weights and the pool stay. Returns the ids of the requests dropped."""
        dropped = list(self._children)
        for request_id in dropped:
            self.abort(request_id)
        self._in_flight = None
        self.kv.reset_prefix_cache()
        self.accelerator.rebind_group(parallel)
        return dropped

    def reset_prefix_cache(self) -> int:
        """Drop cached pages no request holds, on the device and in the host tier."""
        dropped = self.kv.reset_prefix_cache()
        if self.hicache is not None:
            dropped += self.hicache.reset()
        return dropped

    def shutdown(self) -> None:
        self._in_flight = None
        if self.hicache is not None:
            self.hicache.close()  # no copy or disk job may outlive the memory it targets
        self.accelerator.shutdown()


def _needs_ids_only(req: Request) -> bool:
    params = req.params
    return (params.logprobs is None and not params.uses_penalties and
            params.structured is None and len(req.output_token_ids) >= params.min_tokens)


def with_step_limits(config: EngineConfig, caps: Capabilities) -> EngineConfig:
    """The config with the step limits it leaves unset taken from the backend's."""
    s = config.scheduler
    return dataclasses.replace(config, scheduler=dataclasses.replace(
        s, max_num_seqs=s.max_num_seqs or caps.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens or caps.max_num_batched_tokens))


def _check_speculative(config: EngineConfig, accelerator: Accelerator) -> None:
    if config.scheduler.num_speculative_tokens and \
            not accelerator.capabilities.speculative_decoding:
        raise ValueError(f"the {accelerator.name} backend does not run speculative decoding "
                         f"yet; set num_speculative_tokens to 0")


def load_hf_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _select_accelerator(config: EngineConfig) -> Accelerator:
    from deepinfer.core.plugins import load_plugins, select_accelerator

    return select_accelerator(load_plugins(), config.accelerator)()
