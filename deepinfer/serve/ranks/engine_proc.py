"""The rank process: owns one Engine and runs its step loop, fed over ZMQ.

It never blocks on the API: when idle it waits on its input socket, otherwise it drains what
arrived since the last step, steps, and pushes the deltas. It exits when its parent dies.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from deepinfer.core.accelerator import ParallelContext
from deepinfer.core.engine import Engine
from deepinfer.core.outputs import RequestOutput
from deepinfer.serve.grammar.rank_grammars import PendingGrammars
from deepinfer.serve.heap import freeze_startup_heap
from deepinfer.serve.ranks.ipc import (
    AbortRequest,
    AddRequest,
    Control,
    ControlReply,
    EngineStats,
    ExpertStats,
    Failed,
    Heartbeat,
    Ready,
    Regroup,
    RequestError,
    TokenDelta,
)
from deepinfer.serve.ranks.lockstep import Lockstep, RebalanceTimer, init_rank_group, shutdown_group
from deepinfer.serve.ranks.outbox import RankOutbox
from deepinfer.serve.ranks.regroup import await_regroup, rejoin
from deepinfer.serve.ranks.spec import RankSpec, regroups
from deepinfer.serve.ranks.stream_pacing import StreamPacer

log = logging.getLogger("deepinfer.rank")
IDLE_POLL_MS = 200  # how often an idle rank checks that its parent is alive
GRAMMAR_POLL_MS = 5  # how often an otherwise idle rank looks for a prepared grammar (and
# finishes the cache tiers' copies and disk writes)
POOL_REPORT_S = 1.0  # how often an idle rank looks at the node's shared host pool
EXPERT_STATS_EVERY_S = 1.0  # expert load is L x E numbers: reported at most this often
REPORT_LINGER_MS = 10_000  # how long a failed start-up waits for its report to be sent


class StepClock:
    """What the heartbeat thread reports of the step loop: steps taken, and since when the
    current step runs. Plain attributes: one writer (the loop), one reader (the thread)."""

    def __init__(self) -> None:
        self.steps = 0
        self.busy_since: float | None = None

    def begin(self) -> None:
        self.busy_since = time.monotonic()

    def end(self) -> None:
        self.steps += 1
        self.busy_since = None

    def busy_s(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since


class ExpertReporter:
    """EPLB and the expert load of an MoE rank: when to rebalance (the timer, voted on with
    the lockstep), and the ExpertStats it owes the API process."""

    def __init__(self, engine: Engine, rank: int, timer: RebalanceTimer) -> None:
        self.engine, self.rank, self.timer = engine, rank, timer
        self.rebalances, self.last_report = 0, None
        self.sent_at = 0.0

    def wants_rebalance(self) -> bool:
        prefilled, self.engine.last_step_prefilled = self.engine.last_step_prefilled, False
        return self.timer.enabled and self.timer.due(prefilled)

    def rebalance(self) -> None:
        report = self.engine.rebalance_experts()
        self.timer.done()
        if report is None:
            return  # no tokens routed since the last one: nothing to balance
        self.rebalances, self.last_report, self.sent_at = self.rebalances + 1, report, 0.0
        log.info("EPLB rebalance: imbalance (max/mean tokens per rank) %.3f -> %.3f over %d "
                 "tokens, %d expert slots moved, %.1f ms stall", report.imbalance_before,
                 report.imbalance_after, report.window_tokens, report.experts_moved,
                 report.stall_s * 1e3)

    def due_stats(self) -> ExpertStats | None:
        now = time.monotonic()
        if now - self.sent_at < EXPERT_STATS_EVERY_S:
            return None
        self.sent_at = now
        return ExpertStats(self.rank, self.engine.accelerator.expert_load().tolist(),
                           self.rebalances, self.last_report)


def run_rank(spec: RankSpec) -> None:
    """The rank process's life, once ranks/entry.run_rank has set its environment."""
    # The API process decides when we stop: a Ctrl-C or a `server.sh stop` reaches the whole
    # process group, and the API process then drains and stops its ranks itself (a rank that
    # is orphaned exits on its own, see _loop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s %(name)s[rank {spec.rank}]: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    # API processes other than the first bind their input addresses after this connects.
    inbox.setsockopt(zmq.RECONNECT_IVL, 20)
    for addr in spec.input_addrs:  # one per API process; fair-queued
        inbox.connect(addr)
    outbox = RankOutbox(ctx, spec.output_addrs)
    from deepinfer.core.plugins import load_plugins

    registry = load_plugins()
    try:
        engine, lockstep = _start_engine(spec, registry)
        experts = _expert_reporter(engine, spec)
    except Exception:  # noqa: BLE001 - report any start-up failure to the API process
        outbox.send(Failed(spec.rank, traceback.format_exc()))
        # The sockets drop unsent messages when they close (LINGER 0) and the process ends
        # right after this: wait for the report to leave (a loaded machine lost it).
        ctx.destroy(linger=REPORT_LINGER_MS)
        return
    registry.engine_started(spec.config)
    freeze_startup_heap()  # start-up work: before the rank says it is ready for requests
    outbox.send(_ready(engine, spec))
    clock, stop = StepClock(), threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(ctx, spec, clock, stop),
                            name="deepinfer-heartbeat", daemon=True)
    beat.start()
    try:
        failed = _serve(engine, spec, inbox, outbox, parent, clock, lockstep, experts)
    finally:
        stop.set()
        beat.join()
        engine.shutdown()
        shutdown_group()
        registry.engine_stopped(spec.config)
        ctx.destroy(linger=0)
    if failed:
        sys.exit(1)


def _ready(engine: Engine, spec: RankSpec) -> Ready:
    host_pages = engine.hicache.layout.num_pages if engine.hicache is not None else 0
    return Ready(spec.rank, engine.kv.pool.num_usable + 1, engine.kv.block_size,
                 engine.token_limit(), engine.accelerator.name, host_pages, _stats(engine),
                 engine.model.vocab_size, engine.eos_token_ids,
                 engine.accelerator.capabilities.rebind_group)


def _serve(engine: Engine, spec: RankSpec, inbox: zmq.Socket, outbox: RankOutbox,
           parent: int, clock: StepClock, lockstep: Lockstep | None,
           experts: ExpertReporter | None) -> bool:
    """The step loop, joining a new rank group whenever the API process says one of the
    group's ranks was replaced (Regroup); whether the group failed for good (exit 1)."""
    pacer = StreamPacer(spec.stream_interval)
    grammars = PendingGrammars(engine)  # one background thread for the rank's whole life
    while True:
        try:
            regroup = _loop(engine, spec.rank, inbox, outbox, parent, clock, lockstep,
                            experts, pacer, grammars)
        except Exception as exc:  # noqa: BLE001 - below: a group failure is one log line
            if lockstep is None:
                raise
            # A peer died mid-collective (or the group broke): the API process saw the death
            # and says what next, so no traceback.
            log.warning("rank group failed: %s: %s", type(exc).__name__, exc)
            regroup = await_regroup(inbox, outbox, parent) if _stays(engine, spec) else None
            if regroup is None:
                log.error("rank group failed, exiting")
                return True
        if regroup is None:
            return False
        for request_id in grammars.drop_all():  # failed by the API process with the rest
            outbox.forget(request_id)
        try:
            lockstep = rejoin(engine, spec, regroup, outbox, pacer)
        except Exception:  # noqa: BLE001 - the API process then restarts the whole group
            log.exception("could not rejoin the rank group, exiting")
            return True
        outbox.send(_ready(engine, spec))


def _stays(engine: Engine, spec: RankSpec) -> bool:
    """Whether this rank stays through a regroup when a peer is lost (else it exits)."""
    return engine.accelerator.capabilities.rebind_group and \
        regroups(spec.config, spec.world_size)


def _start_engine(spec: RankSpec, registry) -> tuple[Engine, Lockstep | None]:
    accelerator = _accelerator_class(registry, spec.config.accelerator)()
    parallel = spec.config.parallel
    if not (parallel.ep and parallel.world_size > 1):
        context = ParallelContext(spec.rank, spec.world_size)
        return Engine(spec.config, accelerator, parallel=context,
                      shared_host_pool=spec.shared_host_pool), None
    context = init_rank_group(parallel, spec.rank, accelerator.distributed_backend,
                              placement_from=spec.placement_from)
    return Engine(spec.config, accelerator, parallel=context,
                  shared_host_pool=spec.shared_host_pool), Lockstep()


def _accelerator_class(registry, name: str | None) -> type:
    """The backend the server chose, loaded by its name; a rank given none (a RankSpec built
    without the server's preflight) chooses for itself."""
    from deepinfer.core.plugins import load_accelerator, select_accelerator

    return load_accelerator(registry, name) if name else select_accelerator(registry)


def _expert_reporter(engine: Engine, spec: RankSpec) -> ExpertReporter | None:
    parallel = spec.config.parallel
    timer = RebalanceTimer(parallel.eplb_interval, parallel.eplb_after_prefill)
    if engine.accelerator.expert_load() is None:
        if timer.enabled:
            raise ValueError("--eplb-interval / --eplb-after-prefill need an MoE model on a "
                             "backend that reports expert load (Accelerator.expert_load)")
        return None
    if timer.enabled and not (parallel.ep and parallel.world_size > 1):
        raise ValueError("EPLB rebalances experts across ranks: it needs expert parallel "
                         "(--ep with several ranks)")
    return ExpertReporter(engine, spec.rank, timer)


def _heartbeat(ctx: zmq.Context, spec: RankSpec, clock: StepClock,
               stop: threading.Event) -> None:
    """Beat on a socket of this thread's own (ZMQ sockets are not thread-safe)."""
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    out.connect(spec.output_addrs[0])  # the API process that watches the ranks
    pid = os.getpid()
    try:
        while not stop.wait(spec.heartbeat_interval_s):
            try:
                out.send_pyobj(Heartbeat(spec.rank, pid, clock.steps, clock.busy_s()),
                               flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the API process is not reading; it will notice the silence
    finally:
        out.close()


class SharedPoolWatch:
    """The node's shared HiCache pool changes while this rank idles (its peers store, load,
    die): an idle rank reports it, at most every POOL_REPORT_S, so the pool's gauges stay
    true."""

    def __init__(self, engine: Engine) -> None:
        hicache = engine.hicache
        self.hicache = hicache if hicache is not None and hicache.stats().shared else None
        self.last: tuple[int, int] | None = None
        self.checked = 0.0

    def changed(self) -> bool:
        if self.hicache is None or time.monotonic() - self.checked < POOL_REPORT_S:
            return False
        self.checked = time.monotonic()
        stats = self.hicache.stats()  # reaps ranks that died, too
        now, self.last = self.last, (stats.pages_used, stats.pages_pinned)
        return now != self.last


def _loop(engine: Engine, rank: int, inbox: zmq.Socket, outbox: RankOutbox, parent: int,
          clock: StepClock | None = None, lockstep: Lockstep | None = None,
          experts: ExpertReporter | None = None, pacer: StreamPacer | None = None,
          grammars: PendingGrammars | None = None) -> Regroup | None:
    """Until a shutdown, an orphaned rank (None) or a Regroup (returned)."""
    clock, pacer = clock or StepClock(), pacer or StreamPacer()
    # Constrained requests wait there for their grammar.
    grammars = grammars if grammars is not None else PendingGrammars(engine)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    shared_pool = SharedPoolWatch(engine)
    while True:
        # In lockstep a busy peer needs this rank's vote (and dummy step) at once.
        peers_busy = lockstep is not None and lockstep.peers_busy
        background = engine.has_background_work
        timeout = 0 if engine.has_unfinished_requests() or peers_busy else \
            GRAMMAR_POLL_MS if grammars.waiting or background else IDLE_POLL_MS
        errors: list[RequestError] = []
        handled = False
        while poller.poll(timeout):
            timeout = 0
            message = inbox.recv_pyobj()
            if isinstance(message, Control) and message.command == "shutdown":
                outbox.reply(message.client, ControlReply(message.call_id, True))
                return None
            if isinstance(message, Regroup):
                return message
            _handle(engine, message, outbox, errors, grammars)
            _pace(pacer, message)
            handled = True
        for message, grammar in grammars.ready():
            _add(engine, message, errors, grammar)
            handled = True
        if os.getppid() != parent:
            return None  # orphaned: the API process is gone
        if background and not engine.has_unfinished_requests():
            engine.poll_caches()  # write-backs end while the rank idles too
            handled = handled or not engine.has_background_work  # report the drained queue
        if not engine.has_unfinished_requests():
            handled = shared_pool.changed() or handled  # the node's pool moves under it
        outputs = _step(engine, clock, lockstep, experts)
        errors += [RequestError(o.request_id, o.error, 500) for o in outputs if o.error]
        for error in errors:
            pacer.drop(error.request_id)
        deltas = pacer.pace(_delta(o) for o in outputs if o.error is None)
        # Report after handled messages too (an abort frees blocks without any step output)
        # and after steps whose tokens the pacer holds: the API's gauges (running, KV usage)
        # would otherwise keep stale numbers, through a long non-streaming generation too.
        if outputs or errors or handled:
            outbox.step_result(rank, deltas, errors, _stats(engine, grammars.waiting))
        expert_stats = experts.due_stats() if experts is not None else None
        if expert_stats is not None:
            outbox.broadcast(expert_stats)


def _pace(pacer: StreamPacer, message: object) -> None:
    if isinstance(message, AddRequest):
        pacer.admit(message.request_id, message.params.n, message.final_only)
    elif isinstance(message, AbortRequest):
        pacer.drop(message.request_id)


def _step(engine: Engine, clock: StepClock, lockstep: Lockstep | None,
          experts: ExpertReporter | None = None) -> list[RequestOutput]:
    """One engine step if this rank has work; in lockstep, also a dummy step when only a
    peer has, and an EPLB rebalance first when any rank asks for one (every rank takes the
    same branches: the vote is a collective)."""
    busy = engine.has_unfinished_requests()
    if lockstep is not None:
        wants = experts is not None and experts.wants_rebalance()
        anyone_busy, rebalance = lockstep.vote(busy, wants)
        if rebalance and experts is not None:
            experts.rebalance()
        if anyone_busy and not busy:
            clock.begin()
            try:
                engine.dummy_step()
            finally:
                clock.end()
    if not busy:
        return []
    clock.begin()
    try:
        return engine.step()
    finally:
        clock.end()


def _handle(engine: Engine, message: object, outbox: RankOutbox,
            errors: list[RequestError], grammars: PendingGrammars | None = None) -> None:
    if isinstance(message, AddRequest):
        outbox.admit(message.request_id, message.client, message.params.n)
        if grammars is None or not grammars.hold(message):  # held: added once prepared
            _add(engine, message, errors)
    elif isinstance(message, AbortRequest):
        if grammars is not None:
            grammars.drop(message.request_id)
        engine.abort(message.request_id)
        outbox.forget(message.request_id)
    elif isinstance(message, Control):
        outbox.reply(message.client, ControlReply(message.call_id,
                                                  _control(engine, message.command)))


def _add(engine: Engine, message: AddRequest, errors: list[RequestError],
         grammar: object = None) -> None:
    """Add a request to the engine; `grammar`: its prepared grammar, or the exception its
    preparation raised."""
    try:
        if isinstance(grammar, BaseException):
            raise grammar
        engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                           prefix_cache=message.prefix_cache, grammar=grammar)
    except ValueError as exc:
        errors.append(RequestError(message.request_id, str(exc)))
    except Exception as exc:  # noqa: BLE001 - a fault in one request is that request's
        log.error("request %s could not be added", message.request_id, exc_info=exc)
        engine.abort(message.request_id)
        errors.append(RequestError(message.request_id, f"internal error while adding the "
                                   f"request: {type(exc).__name__}: {exc}", 500))


def _control(engine: Engine, command: str) -> object:
    if command == "reset_prefix_cache":
        return engine.reset_prefix_cache()
    if command == "stats":
        return _stats(engine)
    return f"unknown command {command!r}"


def _delta(out: RequestOutput) -> TokenDelta:
    return TokenDelta(out.request_id, out.index, out.new_token_ids, out.new_text, out.finished,
                      out.finish_reason, out.stop_reason, out.new_logprobs,
                      len(out.prompt_token_ids), out.num_cached_tokens, out.prompt_logprobs,
                      times=out.times)


def _stats(engine: Engine, deferred: int = 0) -> EngineStats:
    """`deferred`: requests the rank holds until their grammar is prepared (not yet in the
    scheduler's queue, but waiting all the same)."""
    kv, sched = engine.kv, engine.scheduler
    host = {} if engine.hicache is None else \
        {f"hicache_{k}": v for k, v in vars(engine.hicache.stats()).items()}
    disk = None if engine.hicache is None else engine.hicache.disk_stats()
    if disk is not None:
        host.update({f"hicache_disk_{k}": v for k, v in vars(disk).items()})
    spec = sched.spec_stats
    return EngineStats(len(sched.running), len(sched.waiting) + deferred, kv.usage,
                       kv.pool.num_usable, kv.stats.queries, kv.stats.hits,
                       sched.num_preemptions, dummy_steps=engine.num_dummy_steps,
                       waiting_deferred=deferred,
                       step_token_counts=tuple(engine.step_tokens.counts),
                       step_tokens_sum=engine.step_tokens.total,
                       spec_tokens=spec.num_speculative_tokens, spec_drafts=spec.drafts,
                       spec_draft_tokens=spec.draft_tokens,
                       spec_accepted_tokens=spec.accepted_tokens,
                       spec_accepted_per_position=tuple(spec.accepted_per_position),
                       regions=engine.accelerator.region_times(), **host)
