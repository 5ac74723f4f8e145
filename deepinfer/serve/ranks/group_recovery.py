"""How the API process keeps an expert-parallel group serving when one of its ranks dies.

The ranks of the group run collectives in every MoE layer, so a death breaks every rank's
step: the requests of the whole group fail at once (503). Where this API process owns every
rank of the group (one host), only the dead rank is restarted: the survivors are told at once
(Regroup) to drop their requests and to wait, model and KV pool kept, for the replacement in a
new torch.distributed group on a fresh port; the group serves again when every member has
reported Ready, so the outage is about one rank's start. If that cannot happen (another death
meanwhile, a survivor that cannot rejoin, no Ready in time, or ranks on other hosts that this
process cannot tell), the whole group is taken down and restarted as one.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from deepinfer.serve.ranks.health import RankState
from deepinfer.serve.ranks.ipc import Ready, Regroup
from deepinfer.serve.ranks.rank import RankDiedError

log = logging.getLogger("deepinfer.serve")
LIVE = (RankState.SERVING, RankState.UNHEALTHY)
READY_GRACE_S = 5.0  # past the survivors' own timeout, for their failure to reach us first


@dataclass
class Regrouping:
    """A regroup in progress."""

    lost: int  # the rank being replaced
    started: float  # event-loop time of its death
    waiting: set[int] = field(default_factory=set)  # members that have not reported Ready
    restart: asyncio.Task | None = None  # the lost rank's restart (its backoff, then spawn)


class GroupRecovery:
    """RankSupervisor's handling of its expert-parallel group's deaths (a mixin: it works on
    the supervisor's ranks, router and restarts)."""

    def _group_rank_died(self, rank: int, what: str, failed_start: bool) -> None:
        if self._can_regroup(rank, failed_start):
            self._start_regroup(rank, what)
        else:
            self._take_group_down(rank, what, failed_start)

    def _can_regroup(self, rank: int, failed_start: bool) -> bool:
        if not self._regroups or failed_start or self._regrouping is not None:
            return False
        return all(p.state in LIVE and not p.kill_reason and p.ready.rebind_group
                   for peer, p in enumerate(self._ranks) if peer != rank)

    def _start_regroup(self, lost: int, what: str) -> None:
        survivors = [peer for peer in range(self.num_ranks) if peer != lost]
        reason = f"left its step: its expert-parallel group lost rank {lost}, which {what}"
        for peer in survivors:
            self._leave_step(peer, reason)
        self._fresh_port()
        loop = asyncio.get_running_loop()
        regrouping = Regrouping(lost, loop.time(), set(range(self.num_ranks)))
        self._regrouping = regrouping
        # The replacement's backoff and start, and then some: a survivor waits that long in
        # the new group's collectives, and this process as long for every Ready.
        timeout = self.health.backoff_s(self._ranks[lost].streak) + self.regroup_timeout_s
        regrouping.restart = self._schedule_restart([lost], placement_from=survivors[0])
        if regrouping.restart is None:  # not restarted (the limit): nobody to wait for
            self._take_group_down(lost, what, False)
            return
        message = Regroup(self.config.parallel.master_port, survivors[0], timeout)
        for peer in survivors:  # (one that is gone meanwhile: its sentinel takes it down)
            self.background(self.send(peer, message, missing_ok=True))
        log.warning("expert-parallel group: ranks %s keep their model and wait for rank %d "
                    "in a new group (port %d)", survivors, lost, message.master_port)
        self.background(self._regroup_deadline(regrouping, timeout + READY_GRACE_S))

    def _leave_step(self, peer: int, reason: str) -> None:
        """A survivor: its requests fail now (its step broke off with the dead rank's), and
        it takes none until the group is whole again."""
        p = self._ranks[peer]
        p.state, p.group_reason = RankState.STARTING, reason
        self.router.mark_dead(peer)
        p.lost_requests += self._fail_requests(peer, RankDiedError(peer, None, reason))
        self._publish(peer)

    async def _regroup_deadline(self, regrouping: Regrouping, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self._regrouping is regrouping and not self._closing:
            log.error("expert-parallel group not whole again %.0f s after rank %d was lost; "
                      "restarting the whole group", seconds, regrouping.lost)
            self._take_group_down(regrouping.lost, "was not replaced in time", True)

    def _regroup_ready(self, message: Ready) -> None:
        """A member reported Ready in the new group: when all have, the group serves."""
        r, regrouping = self._ranks[message.rank], self._regrouping
        r.ready, r.stats = message, message.stats
        regrouping.waiting.discard(message.rank)
        if regrouping.waiting:
            return
        self._regrouping = None
        now = asyncio.get_running_loop().time()
        for rank, m in enumerate(self._ranks):
            m.state, m.last_beat, m.group_reason = RankState.SERVING, now, ""
            if rank == regrouping.lost:
                m.serving_since = now
            self.router.mark_alive(rank)
            self._publish(rank)
        log.info("expert-parallel group serving again %.1f s after rank %d was lost (the "
                 "other ranks kept their model)", now - regrouping.started, regrouping.lost)

    def _take_group_down(self, rank: int, what: str, failed_start: bool) -> None:
        """The whole group goes down: every peer is killed (its sentinel then fails its
        requests like any death), and the group restarts as one once the last rank is gone
        (a lone new process could never join the peers' old group)."""
        regrouping, self._regrouping = self._regrouping, None
        if regrouping is not None and regrouping.restart is not None:
            regrouping.restart.cancel()  # (a replacement already spawned is killed below)
        self._group_failed_start |= failed_start
        for peer, p in enumerate(self._ranks):
            if p.state.gone:
                continue
            self.router.mark_dead(peer)  # no new request for it, /health 503 at once
            if not p.kill_reason:  # (a rank the watchdog killed keeps its own reason)
                p.kill_reason = (f"was stopped: its expert-parallel group lost rank {rank}, "
                                 f"which {what}")
            p.process.kill()
        if all(p.state.gone for p in self._ranks):
            failed, self._group_failed_start = self._group_failed_start, False
            self._fresh_port()
            self._schedule_restart(list(range(self.num_ranks)), failed_start=failed)
