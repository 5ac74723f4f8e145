"""What the API process knows of each rank process, and the errors a rank's fate raises."""
from __future__ import annotations

import multiprocessing as mp
import signal
import time
from dataclasses import dataclass, field

import zmq.asyncio

from deepinfer.serve.ranks.health import RankState
from deepinfer.serve.ranks.ipc import EngineStats, ExpertStats, Ready


class EngineRequestError(ValueError):
    """The engine refused (status 400) or failed (500) the request; the message is meant for
    the user."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RankStartError(RuntimeError):
    """A rank could not start the engine (its model, KV pool or device); the message is the
    failure's last line, `details` the rank's whole traceback."""

    def __init__(self, rank: int, details: str) -> None:
        lines = [line for line in details.strip().splitlines() if line.strip()]
        super().__init__(f"engine rank {rank} failed to start: "
                         f"{lines[-1].strip() if lines else 'no reason given'}")
        self.details = details


class RankDiedError(RuntimeError):
    """The rank serving a request exited (or was killed for not responding) before the
    request finished."""

    def __init__(self, rank: int, exitcode: int | None, reason: str = "") -> None:
        what = reason or describe_exit(exitcode)
        super().__init__(f"engine rank {rank} {what} while serving this request; the request "
                         "was lost, retry it")
        self.rank = rank


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exited"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@dataclass
class _Rank:
    process: "mp.process.BaseProcess | RemoteProcess"
    inbox: zmq.asyncio.Socket
    ready: Ready | None = None
    stats: EngineStats | None = None
    lost_requests: int = 0  # in-flight requests failed because this rank died
    state: RankState = RankState.STARTING
    restarts: int = 0  # over the server's life
    streak: int = 0  # restarts since it last served for `stable_after_s` (backoff, limit)
    serving_since: float | None = None  # event-loop time it became ready
    last_beat: float = 0.0  # event-loop time of the last heartbeat (or of Ready)
    kill_reason: str = ""  # why the watchdog killed it (for the failed requests' message)
    busy_s: float = 0.0  # how long its step in progress ran, as of the last heartbeat
    experts: ExpertStats | None = None  # MoE models: its latest expert load and EPLB report
    spawn: int = 0  # which start of the rank this is (its input addresses carry it)
    group_reason: str = ""  # a regroup: why it left its step (for its requests' message)
    # time.monotonic() when it was spawned, until it reports Ready (the log says how long)
    spawned_at: float | None = field(default_factory=time.monotonic)


@dataclass
class RemoteProcess:
    """A rank process as an API process that does not own it knows it (from RankEvents)."""

    pid: int | None
    exitcode: int | None = None
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


@dataclass(frozen=True)
class RankView:
    """One rank as /health and the per-rank metrics show it."""

    rank: int
    alive: bool
    pid: int | None
    exitcode: int | None
    in_flight: int  # requests the API process has sent it and not seen finish
    load_tokens: int  # their prompt tokens (what least-loaded routing compares)
    lost_requests: int
    stats: EngineStats | None  # its latest report (kept after death: totals stay readable)
    state: str = RankState.SERVING.value
    restarts: int = 0
    experts: ExpertStats | None = None
