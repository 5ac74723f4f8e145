"""Rank recovery: how fast `deepinfer-serve --dp 2` notices a dead or frozen rank and serves again.

For each repeat the script starts a fresh `deepinfer-serve --dp 2` (embedded SmolLM2-135M-Instruct
unless --model, the DEFAULT rank-health flags, a small KV pool, one torch thread per rank) and
runs two faults on rank 1, each with a streaming chat request in flight on it (pinned there with
an `x-session-affinity` key whose rendezvous hash lands on rank 1):

- killed: SIGKILL rank 1. Measured from the kill: when the stream ends with its 503 error
  event, when /health shows rank 1 `serving` again (one restart more, a new pid), and when a
  request pinned to rank 1 is answered by rank 1 (`x-deepinfer-rank` header).
- frozen: SIGSTOP rank 1 (SIGCONT in a finally). Measured from the stop: when /health shows it
  `unhealthy`, when the stream ends with its 503 error event (the rank was killed after
  --rank-fail-after), and when it serves again as above. While it is frozen (after `unhealthy`),
  a request pinned to rank 1 must be answered by rank 0: its latency is recorded.

/health is polled every 50 ms, so every time has that resolution. A fresh server per repeat keeps
the restart backoff the same in every repeat (1 s before a rank's first restart, 2 s before its
second: the backoff doubles per restart of a rank). Writes results/rank_recovery.json (every
repeat, medians, the configured limits and measured/configured ratios) and a PNG beside it.

    python benchmarks/rank_recovery.py                 # 3 repeats, ~2.2 min on 2 cores
    python benchmarks/rank_recovery.py --repeats 1 --out /tmp/rr.json   # smoke, ~1 min
    python benchmarks/rank_recovery.py --replot benchmarks/results/rank_recovery.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when run from another folder
from common import (
    free_port,
    log,
    machine_environment,
    pyplot,
    replot,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)

POLL_S = 0.05
RANK = 1  # the rank that is killed / frozen


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder; default: the embedded SmolLM2")
    p.add_argument("--repeats", type=int, default=3, help="fresh servers, each runs both faults")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--stream-tokens", type=int, default=1000,
                   help="max_tokens of the in-flight stream (EOS ignored): "
                        "it must outlast the fault")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for any one event before the run fails")
    p.add_argument("--out", default=os.path.join(HERE, "results", "rank_recovery.json"))
    p.add_argument("--note", default="")
    p.add_argument("--replot", default=None, help="redraw the PNG from this JSON and exit")
    return p.parse_args(argv)


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--dp", "2",
           "--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "4"]
    return cmd + (["--model", args.model] if args.model else [])


def health_limits() -> dict[str, float]:
    """The defaults the server runs with (no health flag is passed)."""
    from deepinfer.serve.ranks.health import RankHealthConfig

    c = RankHealthConfig()
    return {"heartbeat_interval_s": c.heartbeat_interval_s, "watchdog_period_s":
            c.heartbeat_interval_s, "unhealthy_after_s": c.unhealthy_after_s,
            "fail_after_s": c.fail_after_s, "max_restarts": c.max_restarts,
            "backoff_first_restart_s": c.backoff_s(0), "backoff_second_restart_s": c.backoff_s(1)}


# ---- talking to the server -------------------------------------------------------------------
def key_for(rank: int) -> str:
    from deepinfer.serve.ranks.router import Router

    router = Router(2)
    return next(k for k in (f"session-{i}" for i in range(1000)) if router.home(k) == rank)


class Client:
    def __init__(self, base: str, key: str, timeout: float):
        import httpx

        self.base, self.key, self.timeout = base, key, timeout
        self.http = httpx.Client(timeout=30)

    def health(self) -> dict:
        return self.http.get(f"{self.base}/health").json()

    def rank(self, rank: int = RANK) -> dict:
        return self.health()["ranks"][rank]

    def chat(self) -> tuple[int, int | None, float]:
        """A short pinned request: (status, answering rank, seconds)."""
        t0 = time.monotonic()
        reply = self.http.post(f"{self.base}/v1/chat/completions",
                               headers={"x-session-affinity": self.key},
                               json={"messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 4, "temperature": 0})
        rank = reply.headers.get("x-deepinfer-rank")
        return reply.status_code, None if rank is None else int(rank), time.monotonic() - t0

    def until(self, condition, what: str):
        """Poll `condition()` every POLL_S until it is truthy; return (value, monotonic time)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value, time.monotonic()
            time.sleep(POLL_S)
        raise TimeoutError(f"timed out after {self.timeout:.0f} s waiting for {what}")

    def serving_again(self, restarts: int, old_pid: int, t0: float) -> dict[str, Any]:
        """Wait for rank 1 to serve after a restart, then for a pinned request it answers.

        `state_first_seen_s`: when each state was first polled from here on (polling starts
        after the stream ended, so `dead` may be late; `starting` = backoff over, new process
        spawned); `restart_load_s` = serving - starting: spawn and model load."""
        seen: dict[str, float] = {}

        def restarted():
            r = self.rank()
            seen.setdefault(r["state"], round(time.monotonic() - t0, 3))
            return r["state"] == "serving" and r["restarts"] == restarts and r
        back, t_health = self.until(restarted, "rank 1 serving again")
        assert back["pid"] != old_pid, "a restarted rank has a new pid"
        _, t_answer = self.until(lambda: (a := self.chat())[:2] == (200, RANK) and a,
                                        "a pinned request answered by rank 1")
        return {"health_serving_s": round(t_health - t0, 3),
                "answered_by_rank1_s": round(t_answer - t0, 3),
                "restart_load_s": round(t_health - t0 - seen["starting"], 3)
                if "starting" in seen else None,  # None: the restart was never seen starting
                "state_first_seen_s": seen, "restarts": back["restarts"]}


@dataclass
class Stream:
    """A long streaming chat request pinned to rank 1, read in a thread."""
    started: threading.Event = field(default_factory=threading.Event)
    events: list[dict] = field(default_factory=list)
    rank: int | None = None
    status: int | None = None
    ended: float = 0.0
    failure: str = ""

    def run(self, client: Client, max_tokens: int) -> threading.Thread:
        thread = threading.Thread(target=self._read, args=(client, max_tokens), daemon=True)
        thread.start()
        if not self.started.wait(client.timeout):
            raise TimeoutError(f"no first streamed token ({self.failure or 'no error'})")
        if self.rank != RANK:
            raise RuntimeError(f"the pinned stream runs on rank {self.rank}, not {RANK}")
        return thread

    def _read(self, client: Client, max_tokens: int) -> None:
        import httpx

        body = {"messages": [{"role": "user", "content": "tell a long story"}], "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{client.base}/v1/chat/completions", json=body,
                              timeout=60, headers={"x-session-affinity": client.key}) as reply:
                self.status = reply.status_code
                self.rank = int(reply.headers.get("x-deepinfer-rank", -1))
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        if self.tokens():  # a token: the rank is generating it
                            self.started.set()
        except Exception as exc:  # noqa: BLE001 - recorded; the main thread checks
            self.failure = repr(exc)
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def error(self) -> dict | None:
        return self.events[-1].get("error") if self.events else None

    def tokens(self) -> int:
        return sum(1 for e in self.events if e.get("choices")
                   and e["choices"][0].get("delta", {}).get("content"))


def end_of(stream: Stream, thread: threading.Thread, t0: float, timeout: float) -> dict:
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError("the faulted rank's stream did not end")
    error = stream.error()
    if not error or error.get("code") != 503:
        raise RuntimeError(f"the stream did not end with a 503 error event: "
                           f"{stream.events[-1:] or stream.failure}")
    return {"stream_error_s": round(stream.ended - t0, 3), "stream_error_code": error["code"],
            "stream_error_message": error["message"], "stream_tokens_before_end": stream.tokens()}


# ---- the two faults --------------------------------------------------------------------------
def killed(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    before = client.rank()
    stream = Stream()
    thread = stream.run(client, args.stream_tokens)
    t0 = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    _, t_dead = client.until(lambda: not client.rank()["alive"], "the death to show in /health")
    out = {"dead_in_health_s": round(t_dead - t0, 3)}
    status, rank, latency = client.chat()  # its sessions go to the live rank meanwhile
    out.update(rerouted_status=status, rerouted_rank=rank, rerouted_latency_s=round(latency, 3))
    out.update(end_of(stream, thread, t0, args.timeout))
    out.update(client.serving_again(before["restarts"] + 1, before["pid"], t0))
    return out


def frozen(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    before = client.rank()
    stream = Stream()
    thread = stream.run(client, args.stream_tokens)
    os.kill(before["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, t_unhealthy = client.until(lambda: client.rank()["state"] == "unhealthy",
                                      "the frozen rank to be marked unhealthy")
        out = {"unhealthy_s": round(t_unhealthy - t0, 3), "health_status_while_frozen":
               client.health()["status"]}
        status, rank, latency = client.chat()
        out.update(rerouted_status=status, rerouted_rank=rank,
                   rerouted_latency_s=round(latency, 3),
                   rerouted_done_s=round(time.monotonic() - t0, 3))
        out.update(end_of(stream, thread, t0, args.timeout))
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once the watchdog killed it
            os.kill(before["pid"], signal.SIGCONT)
    out.update(client.serving_again(before["restarts"] + 1, before["pid"], t0))
    return out


def run_repeat(args: argparse.Namespace, repeat: int, logdir: str) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = os.path.join(logdir, f"server-{repeat}.log")
    cmd = server_command(args, port)
    server = start_server(cmd, server_log, env={"DEEPINFER_CPU_THREADS": str(args.threads),
                                                "TOKENIZERS_PARALLELISM": "false"})
    try:
        startup = wait_healthy(server, base, server_log, timeout_s=300)
        client = Client(base, key_for(RANK), args.timeout)
        status, rank, _ = client.chat()  # also warms both the path and rank 1
        if (status, rank) != (200, RANK):
            raise RuntimeError(f"the pinned warm-up request got {status} from rank {rank}")
        baseline = [client.chat() for _ in range(3)]
        run = {"repeat": repeat, "server_startup_s": round(startup, 2),
               "pinned_latency_s": round(statistics.median(b[2] for b in baseline), 3),
               "killed": killed(client, args), "frozen": frozen(client, args),
               "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "server_cmd": cmd}
    except Exception:
        with open(server_log) as f:
            log(f"server log tail:\n{f.read()[-3000:]}")
        raise
    finally:
        stop_server(server)
    k, f = run["killed"], run["frozen"]
    log(f"[{repeat}] killed: 503 after {k['stream_error_s']:.2f} s, "
        f"serving {k['health_serving_s']:.2f} s"
        f" | frozen: unhealthy {f['unhealthy_s']:.2f} s, 503 {f['stream_error_s']:.2f} s, "
        f"serving {f['health_serving_s']:.2f} s, rerouted to rank {f['rerouted_rank']} in "
        f"{f['rerouted_latency_s'] * 1000:.0f} ms")
    return run


# ---- summary ---------------------------------------------------------------------------------
def configured(limits: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per metric: the configured time it cannot beat (None: no limit applies) and what it is."""
    u, f = limits["unhealthy_after_s"], limits["fail_after_s"]
    b1, b2 = limits["backoff_first_restart_s"], limits["backoff_second_restart_s"]
    return {
        "killed.stream_error_s": {"configured_s": None, "what": "none: the process sentinel "
                                  "fires at once, no heartbeat limit applies"},
        "killed.health_serving_s": {"configured_s": b1, "what": "backoff of the first restart "
                                    "(+ spawn and model load)"},
        "killed.answered_by_rank1_s": {"configured_s": b1, "what": "backoff (+ load + a request)"},
        "frozen.unhealthy_s": {"configured_s": u, "what": "--rank-unhealthy-after (window: "
                               "- heartbeat interval, + watchdog period)"},
        "frozen.stream_error_s": {"configured_s": f, "what": "--rank-fail-after (same window)"},
        "frozen.health_serving_s": {"configured_s": f + b2, "what": "--rank-fail-after + backoff "
                                    "of the second restart (+ spawn and model load)"},
        "frozen.answered_by_rank1_s": {"configured_s": f + b2, "what": "same (+ a request)"},
        "frozen.rerouted_latency_s": {"configured_s": None, "what": "a pinned request answered by "
                                      "rank 0 while rank 1 is frozen"},
        "killed.restart_load_s": {"configured_s": None, "what": "restart spawned -> serving: "
                                  "process start and model load"},
        "frozen.restart_load_s": {"configured_s": None, "what": "same, second restart"},
    }


def summarize(runs: list[dict], limits: dict[str, float]) -> dict[str, dict[str, Any]]:
    out = {}
    for metric, conf in configured(limits).items():
        scenario, name = metric.split(".")
        values = [r[scenario][name] for r in runs if r[scenario][name] is not None]
        med = statistics.median(values)
        c = conf["configured_s"]
        out[metric] = {"median_s": round(med, 3), "min_s": min(values), "max_s": max(values),
                       "values_s": values, **conf,
                       "ratio_measured_configured": round(med / c, 3) if c else None,
                       "over_configured_s": round(med - c, 3) if c is not None else None}
    return out


LABELS = {
    "killed.stream_error_s": "killed:\nstream 503",
    "killed.health_serving_s": "killed:\nserving (/health)",
    "killed.answered_by_rank1_s": "killed:\nanswered by rank 1",
    "frozen.unhealthy_s": "frozen:\nunhealthy",
    "frozen.stream_error_s": "frozen:\nstream 503",
    "frozen.health_serving_s": "frozen:\nserving (/health)",
    "frozen.answered_by_rank1_s": "frozen:\nanswered by rank 1",
}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    s = result["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [5, 1]})
    for x, metric in enumerate(LABELS):
        m = s[metric]
        color = "C0" if metric.startswith("killed") else "C1"
        ax1.bar(x, m["median_s"], color=color, alpha=0.8)
        ax1.errorbar(x, m["median_s"], yerr=[[m["median_s"] - m["min_s"]],
                                             [m["max_s"] - m["median_s"]]], fmt="none",
                     ecolor="k", capsize=4)
        ax1.text(x, m["max_s"] + 0.2, f"{m['median_s']:.{1 if m['median_s'] >= 1 else 2}f} s",
                 ha="center", fontsize=8)
        if m["configured_s"] is not None:
            ax1.hlines(m["configured_s"], x - 0.4, x + 0.4, colors="r", linestyles="--",
                       label="configured: limit (+ restart backoff)" if x == 1 else None)
    ax1.set_xticks(range(len(LABELS)), list(LABELS.values()), fontsize=8)
    ax1.set_ylabel("seconds after SIGKILL / SIGSTOP of rank 1")
    ax1.set_title("median of repeats, whiskers min-max; red: configured limit (+ backoff)")
    ax1.legend(loc="upper left")
    m = s["frozen.rerouted_latency_s"]
    ms = [v * 1000 for v in m["values_s"]]
    base = [r["pinned_latency_s"] * 1000 for r in result["runs"]]
    ax2.bar([0, 1], [statistics.median(base), statistics.median(ms)], color=["C2", "C1"])
    ax2.plot([0] * len(base), base, "k.")
    ax2.plot([1] * len(ms), ms, "k.")
    ax2.set_xticks([0, 1], ["rank 1,\nhealthy", "rank 0, rank 1\nfrozen"], fontsize=8)
    ax2.set_ylabel("pinned 4-token request, ms")
    ax2.set_title("latency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    lim = result["limits"]
    fig.suptitle(f"deepinfer-serve --dp 2 rank recovery (default limits: unhealthy "
                 f"{lim['unhealthy_after_s']:g} s, fail {lim['fail_after_s']:g} s, heartbeat "
                 f"{lim['heartbeat_interval_s']:g} s, backoff {lim['backoff_first_restart_s']:g}"
                 f"/{lim['backoff_second_restart_s']:g} s); {len(result['runs'])} repeats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, plot)
    limits = health_limits()
    logdir = tempfile.mkdtemp(prefix="rank_recovery_")
    t0 = time.monotonic()
    try:
        runs = [run_repeat(args, repeat, logdir) for repeat in range(args.repeats)]
    finally:
        log(f"server logs: {logdir}")
    result = {"environment": machine_environment(), "note": args.note,
              "settings": {k: v for k, v in vars(args).items() if k != "replot"},
              "limits": limits, "wall_s": round(time.monotonic() - t0, 1),
              "summary": summarize(runs, limits), "runs": runs}
    path = write_json(args.out, result)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    shutil.rmtree(logdir, ignore_errors=True)
    for metric, m in result["summary"].items():
        ratio = m["ratio_measured_configured"]
        print(f"{metric:28s} median {m['median_s']:7.3f} s  (min {m['min_s']:.3f}, max "
              f"{m['max_s']:.3f})  configured {m['configured_s']}  ratio {ratio}")
    log(f"wrote {path} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
