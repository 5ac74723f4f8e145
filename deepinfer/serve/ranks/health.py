"""How the API process judges a rank from its heartbeats, and when it restarts one.

A rank's heartbeat thread reports every `heartbeat_interval_s`. Silence for `unhealthy_after_s`
marks the rank unhealthy: new requests are routed around it, its streams wait. Silence for
`fail_after_s`, or one step busy for `step_timeout_s`, means it will not recover by itself: it
is killed, its in-flight requests fail with 503, and it is restarted. A rank that dies is
restarted after a backoff that doubles with each restart, at most `max_restarts` times in a
row: a rank that then served for `stable_after_s` starts over (so occasional deaths over a long
life never use the budget up).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RankState(str, enum.Enum):
    STARTING = "starting"  # spawned (first start or restart), not ready yet
    SERVING = "serving"
    UNHEALTHY = "unhealthy"  # heartbeats late: routed around, requests kept
    DEAD = "dead"  # exited; restarting after a backoff
    FAILED = "failed"  # exited too often in a row (--max-rank-restarts): not restarted

    @property
    def gone(self) -> bool:
        """The process has exited (restarting or not)."""
        return self in (RankState.DEAD, RankState.FAILED)


@dataclass(frozen=True)
class RankHealthConfig:
    heartbeat_interval_s: float = 0.5
    unhealthy_after_s: float = 3.0
    fail_after_s: float = 10.0
    # One step can legitimately be long (a big prefill on a CPU); past this it is a hang.
    step_timeout_s: float = 600.0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    stable_after_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.unhealthy_after_s <= self.fail_after_s:
            raise ValueError("rank health needs 0 < heartbeat interval < unhealthy-after <= "
                             "fail-after")
        if self.step_timeout_s <= 0 or self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError("step timeout must be > 0; restarts and backoff >= 0")

    def backoff_s(self, restarts: int) -> float:
        """Wait before restart number `restarts + 1`."""
        return min(self.restart_backoff_s * 2 ** restarts, self.max_restart_backoff_s)


class Verdict(str, enum.Enum):
    OK = "ok"
    UNHEALTHY = "unhealthy"
    KILL = "kill"


def judge(config: RankHealthConfig, silent_s: float, busy_s: float) -> tuple[Verdict, str]:
    """What to do with a serving rank that last beat `silent_s` ago, reporting a step busy
    for `busy_s`; with the reason, for the log and the failed requests' message."""
    if silent_s >= config.fail_after_s:
        return Verdict.KILL, f"sent no heartbeat for {silent_s:.1f} s"
    if busy_s >= config.step_timeout_s:
        return Verdict.KILL, f"has been in one step for {busy_s:.0f} s"
    if silent_s >= config.unhealthy_after_s:
        return Verdict.UNHEALTHY, f"sent no heartbeat for {silent_s:.1f} s"
    return Verdict.OK, ""
