"""API-layer overhead: deepinfer-serve (HTTP + SSE + ZMQ rank process) vs the offline engine.

Same model (the embedded SmolLM2-135M-Instruct, float32, or --model), same scheduler settings,
same prompts (random token ids, different for every request, prefix cache off per request),
greedy, EOS ignored, so both sides do exactly the same model work and the difference is the
API layer.

For each concurrency level C a *wave* is C requests submitted at once:

  server   C streaming clients (httpx, or the official AsyncOpenAI client with --client openai)
           POST /v1/completions {prompt: [token ids], stream: true} at the same instant; every
           SSE chunk carries one token and is timestamped when the client reads it. Keep-alive
           connections are opened before the wave, so no TCP set-up is timed.
  offline  LLM(...).engine.add_request() for all C requests at t0, then step() until done;
           every output is timestamped when step() returns it.

  TTFT = submit -> first token, ITL = gaps between a request's tokens (pooled over all
  requests of all repeats, p50/p99), output tok/s = output tokens of the wave / its wall time
  (median over repeats). ratio = server / offline (TTFT/ITL: >1 is slower; tok/s: <1 is slower).

The API layer's own latency is also measured directly: the server runs with a timestamp hook on
Engine.add_request / Engine.step (see _install_engine_trace), which gives submit -> engine and
step() -> client per token, free of the model's own time. The API process's and rank's CPU
seconds per wave are recorded too (psutil), as is the CPU
used by processes that are not part of the benchmark (this machine may be shared), so noisy
numbers can be told apart from real overhead. --profile samples the API process with py-spy
during one extra server wave at the highest level and stores its hottest frames in the JSON.

    python benchmarks/serve_overhead.py               # levels 1,16,64; 128 prompt / 64 output
    python benchmarks/serve_overhead.py --quick       # smoke run: levels 1,4; 32 / 8 tokens
    python benchmarks/serve_overhead.py --profile     # + py-spy of the API process
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # `common`, also when imported as __mp_main__ or run from elsewhere
from common import (  # noqa: E402
    free_port,
    log,
    machine_environment,
    module_versions,
    percentile,
    pyplot,
    random_prompts,
    stop_server,
    wait_healthy,
    write_json,
)
from common import start_server as _start

TRACE_ENV = "DEEPINFER_BENCH_TRACE_DIR"


# ---- engine-side timestamps (server only) --------------------------------------------------------
# The server is started as `python serve_overhead.py --serve ...` with TRACE_ENV set. Its rank
# process is a multiprocessing "spawn" child, which imports this file as __mp_main__ before it
# runs, so the hook below is installed in the rank too: Engine.add_request and Engine.step then
# append one line per call (perf_counter, which is CLOCK_MONOTONIC and so comparable across
# processes) to a file per process. The benchmark joins those lines with what its clients saw:
#   request path = client submit -> engine.add_request   (HTTP, validation, ZMQ hop)
#   token path   = step() returned the token -> client read its SSE chunk
# Both are pure API-layer latency, measured without the model's own (noisy) time. The hook
# costs a few microseconds a step; the server code itself is not changed.
def _install_engine_trace(folder: str) -> None:
    from deepinfer.core.engine import Engine

    if getattr(Engine, "_bench_traced", False):
        return
    out = open(os.path.join(folder, f"engine-{os.getpid()}.log"), "a", buffering=1)
    add, step = Engine.add_request, Engine.step

    def traced_add(self, request_id, *a, **kw):
        add(self, request_id, *a, **kw)
        out.write(f"A {time.perf_counter():.6f} {request_id}\n")

    def traced_step(self):
        outputs = step(self)
        if outputs:
            now = time.perf_counter()
            out.write(f"S {now:.6f} " + " ".join(
                f"{o.request_id}:{len(o.new_token_ids)}" for o in outputs) + "\n")
        return outputs

    Engine.add_request, Engine.step, Engine._bench_traced = traced_add, traced_step, True

    # In the API process: when a request's stream starts (parsed, validated, about to be sent
    # to the rank), which splits the request path into HTTP/FastAPI and the hop to the rank.
    from deepinfer.serve.ranks.request_stream import RequestStream

    generate = RequestStream.generate

    def traced_generate(self, request_id, *a, **kw):
        out.write(f"G {time.perf_counter():.6f} {request_id}\n")
        return generate(self, request_id, *a, **kw)

    RequestStream.generate = traced_generate

    # When a request's last delta reaches the API process: splits a stream's end into the
    # hop from the rank and what the API and the client do after it.
    dispatch = RequestStream.dispatch

    def traced_dispatch(self, result):
        dispatch(self, result)
        ends = [d.request_id for d in result.deltas if d.finished]
        if ends:
            out.write(f"F {time.perf_counter():.6f} " + " ".join(ends) + "\n")

    RequestStream.dispatch = traced_dispatch


if os.environ.get(TRACE_ENV):
    _install_engine_trace(os.environ[TRACE_ENV])


@dataclass
class EngineTrace:
    added: dict[str, float]  # request id -> engine.add_request
    tokens: dict[str, list[float]]  # -> when each of its tokens' steps returned
    started: dict[str, float]  # -> API stream start
    ended: dict[str, float]  # -> its last delta reached the API process


def read_engine_trace(folder: str) -> EngineTrace:
    added: dict[str, float] = {}
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    tokens: dict[str, list[float]] = collections.defaultdict(list)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3 or not line.endswith("\n"):
                    continue
                t = float(parts[1])
                if parts[0] == "A":
                    added[parts[2]] = t
                elif parts[0] == "G":
                    started[parts[2]] = t
                elif parts[0] == "F":
                    ended.update((rid, t) for rid in parts[2:])
                else:
                    for item in parts[2:]:
                        rid, _, n = item.rpartition(":")
                        tokens[rid].extend([t] * int(n))
    return EngineTrace(added, tokens, started, ended)


# ---- sizes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    levels: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 128
    output_len: int = 64
    # Timed waves per side and level; a 64-request wave takes ~50 s on 2 cores, so fewer.
    repeats: tuple[int, ...] = (3, 2, 2)


QUICK = Sizes(levels=(1, 4), prompt_len=32, output_len=8, repeats=(1, 1))


# ---- one wave ----------------------------------------------------------------------------------
@dataclass
class Wave:
    side: str  # "server" | "offline"
    level: int
    repeat: int
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    cpu: dict = field(default_factory=dict)  # seconds of CPU per process group during the wave
    loadavg: tuple[float, float] | None = None  # 1-min load average before / after
    request_path_s: list[float] = field(default_factory=list)  # server: submit -> add_request
    http_path_s: list[float] = field(default_factory=list)  # server: submit -> API stream start
    token_path_s: list[float] = field(default_factory=list)  # server: step() -> client
    # When the engine's steps that gave this wave's tokens returned, from the wave's start:
    # where a slower wave loses its time (ramp-in, mixed steps, the decode tail).
    step_s: list[float] = field(default_factory=list)
    # server, per request: its last step -> its last delta in the API process, and -> the
    # client's stream closed ([DONE] read, response released).
    end_api_s: list[float] = field(default_factory=list)
    end_token_s: list[float] = field(default_factory=list)  # -> the client read that token
    end_client_s: list[float] = field(default_factory=list)
    joined_tokens: int = 0  # server: tokens that reached the client in another token's chunk

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {"side": self.side, "level": self.level, "repeat": self.repeat,
                "wall_s": self.wall_s, "output_tokens": self.output_tokens,
                "output_tok_s": self.output_tok_s, "cpu_s": self.cpu, "loadavg_1m": self.loadavg,
                "ttft_ms": [round(t * 1e3, 2) for t in self.ttft_s],
                "itl_ms_p50": percentile([t * 1e3 for t in self.itl_s], 50),
                "itl_ms_p99": percentile([t * 1e3 for t in self.itl_s], 99),
                "request_path_ms": [round(t * 1e3, 3) for t in self.request_path_s],
                "http_path_ms": [round(t * 1e3, 3) for t in self.http_path_s],
                "token_path_ms_p50": percentile([t * 1e3 for t in self.token_path_s], 50),
                "token_path_ms_p99": percentile([t * 1e3 for t in self.token_path_s], 99),
                "joined_tokens": self.joined_tokens,
                "end_api_ms_p50": percentile([t * 1e3 for t in self.end_api_s], 50),
                "end_api_ms_max": max(self.end_api_s, default=0.0) * 1e3,
                "end_token_ms_p50": percentile([t * 1e3 for t in self.end_token_s], 50),
                "end_token_ms_max": max(self.end_token_s, default=0.0) * 1e3,
                "end_client_ms_p50": percentile([t * 1e3 for t in self.end_client_s], 50),
                "end_client_ms_max": max(self.end_client_s, default=0.0) * 1e3,
                "steps_ms": [round(t * 1e3, 2) for t in self.step_s],
                "phases_ms": phases(self.step_s, self.ttft_s, self.wall_s)}


def phases(step_s: list[float], ttft_s: list[float], wall_s: float) -> dict:
    """A wave's wall split at its last first token: the steps until then (prompts), the
    decode tail's steps after it, and the time from the last step to the wave's end (the
    last tokens' way to the client)."""
    if not step_s or not ttft_s:
        return {}
    last_first = max(ttft_s)
    tail = [t for t in step_s if t > last_first]
    gaps = [b - a for a, b in zip(tail, tail[1:])]
    return {"first_step": round(step_s[0] * 1e3, 2), "last_first_token": round(last_first * 1e3, 2),
            "steps": len(step_s), "tail_steps": len(tail),
            "tail_gap_p50": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "tail_gap_max": round(max(gaps) * 1e3, 3) if gaps else None,
            "last_step_to_end": round((wall_s - step_s[-1]) * 1e3, 2)}


def per_request(t0s: list[float], times: list[list[float]]) -> tuple[list[float], list[float]]:
    ttft, itl = [], []
    for t0, ts in zip(t0s, times):
        if ts:
            ttft.append(ts[0] - t0)
            itl.extend(b - a for a, b in zip(ts, ts[1:]))
    return ttft, itl


# ---- CPU accounting ------------------------------------------------------------------------------
class CpuMeter:
    """CPU seconds of the API process(es), its rank(s), this process and everything else. The
    server's children that loaded torch are its ranks; the others are API processes
    (--api-server-count) and multiprocessing's resource tracker (idle)."""

    def __init__(self, server_pid: int | None) -> None:
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.api = psutil.Process(server_pid) if server_pid else None
        self._is_rank: dict[int, bool] = {}

    def _proc(self, p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except self.psutil.Error:
            return 0.0

    def _split(self) -> tuple[list, list]:
        """(API processes, ranks) among the server's processes."""
        if self.api is None:
            return [], []
        api, ranks = [self.api], []
        for child in self.api.children(recursive=True):
            if child.pid not in self._is_rank:  # read once: a process's maps are long
                self._is_rank[child.pid] = self._loaded_torch(child)
            (ranks if self._is_rank[child.pid] else api).append(child)
        return api, ranks

    def _loaded_torch(self, p) -> bool:
        try:
            return any("libtorch" in m.path for m in p.memory_maps(grouped=True))
        except self.psutil.Error:
            return False

    def sample(self) -> dict:
        api, ranks = self._split()
        t = self.psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        # This process and its client processes (the server is a child too, counted above).
        clients = sum(self._proc(c) for c in self.me.children()
                      if self.api is None or c.pid != self.api.pid)
        return {"api": sum(map(self._proc, api)), "rank": sum(map(self._proc, ranks)),
                "bench": self._proc(self.me) + clients, "system_busy": busy}

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        d = {k: round(b[k] - a[k], 3) for k in a}
        d["other"] = round(max(0.0, d["system_busy"] - d["api"] - d["rank"] - d["bench"]), 3)
        return d


# ---- offline -------------------------------------------------------------------------------------
def offline_wave(llm, prompts: list[list[int]], output_len: int, level: int, repeat: int,
                 meter: CpuMeter) -> Wave:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    rids = [f"off-{level}-{repeat}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    times: dict[str, list[float]] = {rid: [] for rid in rids}
    load0, cpu0 = os.getloadavg()[0], meter.sample()
    t0 = time.perf_counter()
    for rid, ids in zip(rids, prompts):
        engine.add_request(rid, ids, params, prefix_cache=False)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times[out.request_id].extend([now] * len(out.new_token_ids))
    end = time.perf_counter()
    cpu = CpuMeter.delta(cpu0, meter.sample())
    ttft, itl = per_request([t0] * len(rids), [times[r] for r in rids])
    wave = Wave("offline", level, repeat, end - t0, sum(len(v) for v in times.values()), ttft,
                itl, cpu, (load0, os.getloadavg()[0]))
    wave.step_s = sorted({t - t0 for ts in times.values() for t in ts})
    return wave


# ---- server --------------------------------------------------------------------------------------
def start_server(model_dir: str, port: int, args: argparse.Namespace, log_path: str,
                 trace_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--model", model_dir, "--dtype",
           args.dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--load-format",
           args.load_format, "--log-level", "warning"]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.stream_interval > 1:
        cmd += ["--stream-interval", str(args.stream_interval)]
    if args.api_server_count > 1:
        cmd += ["--api-server-count", str(args.api_server_count)]
    return _start(cmd, log_path, {TRACE_ENV: trace_dir})


async def _httpx_request(client, base: str, body: dict
                         ) -> tuple[float, list[float], int, str, float]:
    times: list[float] = []
    usage = 0
    cid = ""
    t0 = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("choices"):
                times.append(now)  # one engine delta = one token per chunk
                cid = chunk["id"]
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return t0, times, usage, cid, time.perf_counter()


async def _openai_request(client, model: str, body: dict
                          ) -> tuple[float, list[float], int, str, float]:
    times: list[float] = []
    usage = 0
    cid = ""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=body["prompt"], max_tokens=body["max_tokens"], temperature=0.0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "prefix_cache": False})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            times.append(now)
            cid = chunk.id
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return t0, times, usage, cid, time.perf_counter()


async def _server_wave_async(base: str, model: str, prompts: list[list[int]], output_len: int,
                             client_kind: str, start_at: float | None = None
                             ) -> tuple[float, float, list[tuple]]:
    """The prompts' streams, sent together (at perf_counter() == start_at, if given, so client
    processes start as one wave: perf_counter is the machine's monotonic clock)."""
    import httpx

    n = len(prompts)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as http:
        # Open n keep-alive connections first: the wave then times no TCP set-up.
        await asyncio.gather(*(http.get(f"{base}/health") for _ in range(n)))
        bodies = [{"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0.0,
                   "stream": True, "stream_options": {"include_usage": True},
                   "ignore_eos": True, "prefix_cache": False} for ids in prompts]
        if client_kind == "openai":
            from openai import AsyncOpenAI

            oai = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", http_client=http,
                              max_retries=0)
            coros = [_openai_request(oai, model, b) for b in bodies]
        else:
            coros = [_httpx_request(http, base, b) for b in bodies]
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        results = await asyncio.gather(*coros)
        end = time.perf_counter()
    return start, end, results


def _client_part(base: str, model: str, prompts: list[list[int]], output_len: int,
                 client_kind: str, start_at: float) -> tuple[float, float, list[tuple]]:
    """One client process's share of a wave (a Pool worker)."""
    return asyncio.run(_server_wave_async(base, model, prompts, output_len, client_kind,
                                          start_at))


@dataclass
class ClientProcesses:
    """A pool of `count` client processes (--client-procs) that a wave's streams are dealt to."""
    pool: Any
    count: int


def _send_wave(base: str, model: str, prompts: list[list[int]], output_len: int,
               client_kind: str, clients: ClientProcesses | None
               ) -> tuple[float, float, list[tuple]]:
    """The wave from this process, or dealt to the client processes: at 256 streams one
    Python client saturates its core and times itself, not the server."""
    if clients is None:
        return asyncio.run(_server_wave_async(base, model, prompts, output_len, client_kind))
    procs = clients.count
    parts = [prompts[i::procs] for i in range(procs) if prompts[i::procs]]
    start_at = time.perf_counter() + 2.0  # every process has connected by then
    done = clients.pool.starmap(_client_part, [
        (base, model, part, output_len, client_kind, start_at) for part in parts])
    results: list[tuple] = [None] * len(prompts)
    for i, (_, _, part) in enumerate(done):
        results[i::procs] = part
    return min(d[0] for d in done), max(d[1] for d in done), results


def _print_tail(path: str, lines: int = 40) -> None:
    with open(path, errors="replace") as f:
        tail = [line for line in f if " 200 OK" not in line][-lines:]
    log(f"last lines of {path} (request logs left out):\n" + "".join(tail))


def server_wave(base: str, model: str, prompts: list[list[int]], output_len: int, level: int,
                repeat: int, client_kind: str, meter: CpuMeter, trace_dir: str,
                clients: ClientProcesses | None = None) -> Wave:
    """A chunk may hold several tokens: with --stream-interval > 1, and where the API process
    fell behind the steps and joined a stream's waiting deltas (coalesce). Token counts are
    checked against usage; ITL is per chunk; the token path only over streams that got a
    chunk per token (the engine's token times are matched to chunks one to one)."""
    load0, cpu0 = os.getloadavg()[0], meter.sample()
    start, end, results = _send_wave(base, model, prompts, output_len, client_kind, clients)
    cpu = CpuMeter.delta(cpu0, meter.sample())
    t0s, times, usage, cids, ends = (list(x) for x in zip(*results))
    chunks = [len(t) for t in times]
    if any(u != output_len or not 0 < c <= u for c, u in zip(chunks, usage)):
        raise RuntimeError(f"token counts differ: chunks {chunks[:8]}, usage {usage[:8]}, "
                           f"wanted {output_len} each")
    ttft, itl = per_request(t0s, times)
    wave = Wave("server", level, repeat, end - start, sum(usage), ttft, itl, cpu,
                (load0, os.getloadavg()[0]))
    wave.joined_tokens = sum(usage) - sum(chunks)
    # A completion of one prompt runs in the engine as "<completion id>-0".
    trace = read_engine_trace(trace_dir)
    wave.step_s = sorted({t - start for cid in cids for t in trace.tokens.get(f"{cid}-0", [])})
    for t0, ts, cid, t_end in zip(t0s, times, cids, ends):
        rid = f"{cid}-0"
        if rid in trace.added:
            wave.request_path_s.append(trace.added[rid] - t0)
        if rid in trace.started:
            wave.http_path_s.append(trace.started[rid] - t0)
        steps = trace.tokens.get(rid, [])
        if len(steps) == len(ts):
            wave.token_path_s.extend(c - e for c, e in zip(ts, steps))
        if steps and ts:
            wave.end_token_s.append(ts[-1] - steps[-1])
            wave.end_client_s.append(t_end - steps[-1])
            if rid in trace.ended:
                wave.end_api_s.append(trace.ended[rid] - steps[-1])
    return wave


# ---- profiling -----------------------------------------------------------------------------------
def profile_api(pid: int, seconds: float, run_wave) -> dict:
    """py-spy the API process (not its ranks) while run_wave() runs; return the hot frames."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    fd, raw = tempfile.mkstemp(suffix=".txt", prefix="serve-overhead-pyspy-")
    os.close(fd)
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", str(PYSPY_RATE), "--format", "raw", "--nonblocking",
                             "--output", raw], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # let py-spy attach
    t0 = time.perf_counter()
    wave = run_wave()
    sampled_s = min(seconds, time.perf_counter() - t0 + 1.0)
    try:
        _, err = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    try:
        summary = summarize_collapsed(raw)
        summary["on_cpu_fraction"] = round(summary["samples"] / (PYSPY_RATE * sampled_s), 3)
    except (OSError, ValueError) as exc:
        summary = {"error": f"{exc}; py-spy: {err.decode(errors='replace')[-500:]}"}
    finally:
        if os.path.exists(raw):
            os.unlink(raw)
    summary["wave"] = wave.as_dict()
    return summary


PYSPY_RATE = 200  # samples a second


def summarize_collapsed(path: str, top: int = 25) -> dict:
    """Inclusive and self sample shares per frame from py-spy's collapsed ('raw') stacks.

    py-spy without --idle records only threads that are on a CPU, so every sample is work."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = [fr for fr in stack.split(";") if fr]
            # Skip the thread name py-spy puts first.
            frames = [fr for fr in frames if "(" in fr]
            if not frames:
                continue
            total += n
            own[_short(frames[-1])] += n
            for fr in set(map(_short, frames)):
                inclusive[fr] += n
    busy = max(1, total)
    return {"samples": total,
            "top_inclusive_pct": [(f, round(100 * c / busy, 1))
                                  for f, c in inclusive.most_common(top)],
            "top_self_pct": [(f, round(100 * c / busy, 1)) for f, c in own.most_common(top)]}


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"; the line number splits one function.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = where.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


# ---- report --------------------------------------------------------------------------------------
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s")


def median_phases(phases_list: list[dict]) -> dict:
    keys = [k for k in (phases_list[0] if phases_list else {})
            if all(p.get(k) is not None for p in phases_list)]
    return {k: statistics.median(p[k] for p in phases_list) for k in keys}


def summarize(waves: list[Wave], levels: tuple[int, ...]) -> list[dict]:
    rows = []
    for level in levels:
        row: dict = {"level": level}
        for side in ("offline", "server"):
            ws = [w for w in waves if w.side == side and w.level == level]
            if not ws:
                continue
            ttft = [t * 1e3 for w in ws for t in w.ttft_s]
            itl = [t * 1e3 for w in ws for t in w.itl_s]
            req = [t * 1e3 for w in ws for t in w.request_path_s]
            http = [t * 1e3 for w in ws for t in w.http_path_s]
            tok = [t * 1e3 for w in ws for t in w.token_path_s]
            cpu = {k: statistics.median(w.cpu[k] for w in ws) for k in ws[0].cpu}
            dicts = [w.as_dict() for w in ws]
            tokens = sum(w.output_tokens for w in ws)

            def per_token(key: str) -> float:
                return round(1e3 * sum(w.cpu[key] for w in ws) / tokens, 3)

            row[side] = {
                "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
                "output_tok_s": statistics.median(w.output_tok_s for w in ws),
                "wall_s": statistics.median(w.wall_s for w in ws), "waves": len(ws),
                "requests": sum(len(w.ttft_s) for w in ws), "itl_samples": len(itl),
                "cpu_s_median": cpu,
                # CPU cost per output token, little affected by other load (no spinning at
                # one thread): offline = the engine; server = rank + API process + clients.
                "cpu_ms_per_token": ({"engine": per_token("bench")} if side == "offline" else
                                     {"rank": per_token("rank"), "api": per_token("api"),
                                      "client": per_token("bench")}),
                # Pure API-layer latency (server only; see _install_engine_trace).
                **({"request_path_p50_ms": percentile(req, 50),
                    "request_path_p99_ms": percentile(req, 99),
                    "http_path_p50_ms": percentile(http, 50),
                    "http_path_p99_ms": percentile(http, 99),
                    "token_path_p50_ms": percentile(tok, 50),
                    "token_path_p99_ms": percentile(tok, 99),
                    "token_path_samples": len(tok),
                    "joined_tokens": sum(w.joined_tokens for w in ws),
                    # A stream's end: its last step -> its last delta in the API process / the
                    # client done with the stream (the slowest of a wave sets the wave's end).
                    **{f"end_{k}_{q}_ms": statistics.median(d[f"end_{k}_ms_{q}"]
                                                            for d in dicts)
                       for k in ("api", "token", "client") for q in ("p50", "max")}}
                   if side == "server" else {}),
                "phases_ms_median": median_phases([d["phases_ms"] for d in dicts]),
                # Cores kept busy by processes outside the benchmark (noise), wave average.
                "other_cores_busy": round(statistics.median(w.cpu["other"] / w.wall_s
                                                            for w in ws), 2),
            }
        if "offline" in row and "server" in row:
            row["ratio_server_over_offline"] = {
                m: (row["server"][m] / row["offline"][m]) if row["offline"][m] else None
                for m in METRICS}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'C':>3s} {'side':8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} "
             f"{'ITL p99':>8s} {'out tok/s':>9s}  {'CPU ms/token':>20s}  {'noise':>5s}",
             f"{'':12s} {'ms':>9s} {'ms':>9s} {'ms':>8s} {'ms':>8s} {'':9s}  "
             f"{'(rank+api+client)':>20s}  {'cores':>5s}"]
    f = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
    for r in rows:
        for side in ("offline", "server"):
            if side not in r:
                continue
            s = r[side]
            lines.append(f"{r['level']:>3d} {side:8s} {s['ttft_p50_ms']:9.1f} "
                         f"{s['ttft_p99_ms']:9.1f} {s['itl_p50_ms'] or 0:8.1f} "
                         f"{s['itl_p99_ms'] or 0:8.1f} {s['output_tok_s']:9.1f}  "
                         f"{_cpu_text(s['cpu_ms_per_token']):>20s}  "
                         f"{s['other_cores_busy']:5.2f}")
        if "ratio_server_over_offline" in r:
            x = r["ratio_server_over_offline"]
            lines.append(f"{r['level']:>3d} {'ratio':8s} {f(x['ttft_p50_ms']):>9s} "
                         f"{f(x['ttft_p99_ms']):>9s} {f(x['itl_p50_ms']):>8s} "
                         f"{f(x['itl_p99_ms']):>8s} {f(x['output_tok_s']):>9s}")
    lines += ["", "API-layer latency measured directly (server; engine timestamps joined with "
              "the clients'):",
              f"{'C':>3s} {'submit->API handler':>20s} {'submit->engine':>15s} "
              f"{'token: step()->client':>22s}   (ms, p50 / p99)"]
    for r in rows:
        s = r.get("server")
        if s and s.get("token_path_p50_ms") is not None:
            pair = lambda k: f"{s[k + '_p50_ms']:.1f} / {s[k + '_p99_ms']:.1f}"  # noqa: E731
            lines.append(f"{r['level']:>3d} {pair('http_path'):>20s} {pair('request_path'):>15s} "
                         f"{pair('token_path'):>22s}")
    return "\n".join(lines)


def _plot_api_latency(ax, rows: list[dict], levels: list[int]) -> None:
    """The API layer's own latency: submit -> engine, and engine step -> client, per level."""
    width = 0.27
    parts = [("http_path", "submit -> API handler", "#8c564b"),
             ("request_path", "submit -> engine.add_request", "#9467bd"),
             ("token_path", "step() -> client reads token", "#ff7f0e")]
    for j, (key, label, color) in enumerate(parts):
        for i, r in enumerate(rows):
            s = r.get("server", {})
            v, hi = s.get(f"{key}_p50_ms"), s.get(f"{key}_p99_ms")
            if v is None:
                continue
            x = i + (j - 1) * width
            ax.bar(x, v, width, color=color, label=label if i == 0 else None,
                   yerr=[[0], [max(0.0, hi - v)]], capsize=3)
            ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.1f}", (x, hi), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(levels)), [f"{c} client{'s' if c > 1 else ''}" for c in levels])
    ax.set_title("API-layer latency, ms (bar p50, whisker p99)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def _cpu_text(c: dict) -> str:
    if "engine" in c:
        return f"{c['engine']:.1f}"
    return f"{c['rank']:.1f}+{c['api']:.2f}+{c['client']:.2f}"


def plot(rows: list[dict], path: str, env: dict, sizes: Sizes) -> None:
    plt = pyplot()

    panels = [("TTFT (ms)", "ttft"), ("ITL (ms)", "itl"), ("output tok/s", None)]
    colors = {"offline": "#1f77b4", "server": "#d62728"}
    levels = [r["level"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    _plot_api_latency(axes[3], rows, levels)
    for ax, (title, key) in zip(axes, panels):
        width = 0.38
        top = 0.0
        for j, side in enumerate(("offline", "server")):
            for i, r in enumerate(rows):
                if side not in r:
                    continue
                s = r[side]
                x = i + (j - 0.5) * width
                if key is None:
                    v, hi = s["output_tok_s"], s["output_tok_s"]
                    ax.bar(x, v, width, color=colors[side], label=side if i == 0 else None)
                else:
                    v, hi = s[f"{key}_p50_ms"] or 0, s[f"{key}_p99_ms"] or 0
                    ax.bar(x, v, width, color=colors[side], label=side if i == 0 else None,
                           yerr=[[0], [max(0.0, hi - v)]], capsize=3)
                top = max(top, hi)
                text = f"{v:.0f}" if v >= 10 else f"{v:.1f}"
                ratio = r.get("ratio_server_over_offline", {})
                metric = "output_tok_s" if key is None else f"{key}_p50_ms"
                if side == "server" and ratio.get(metric):
                    text += f"\n{ratio[metric]:.2f}x"
                ax.annotate(text, (x, hi), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(levels)), [f"{c} client{'s' if c > 1 else ''}" for c in levels])
        ax.set_ylim(0, top * 1.25 if top else 1)
        sub = "bar p50, whisker p99" if key else "median over waves"
        ax.set_title(f"{title} ({sub})", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    where = env.get("gpu") or f"{env['logical_cores']} CPU cores"
    other_busy = statistics.median(r[s]["other_cores_busy"] for r in rows
                                   for s in ("offline", "server") if s in r)
    fig.suptitle(f"deepinfer-serve vs offline engine: {env['model']} {env.get('dtype', '')} on "
                 f"{where}; {sizes.prompt_len} prompt / {sizes.output_len} output tokens per "
                 "request; label under value = server/offline\nother processes kept "
                 f"{other_busy:.1f}"
                 " cores busy on average (noise)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(model_dir: str, threads: int, client: str, dtype: str) -> dict:
    import torch

    versions = module_versions(("fastapi", "uvicorn", "httpx", "openai", "zmq", "uvloop",
                                "httptools"))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return machine_environment() | {
        "torch_threads": threads, "torch": torch.__version__, "versions": versions,
        "client": client, "model": os.path.basename(os.path.normpath(model_dir)),
        "model_path": model_dir, "dtype": dtype,
        "accelerator": os.environ.get("DEEPINFER_ACCELERATOR", "auto"), "gpu": gpu}


# ---- main ----------------------------------------------------------------------------------------
def default_threads() -> int:
    """All cores but one: the server's API process (and the clients) need a core of their own.

    With every core given to torch, whatever else runs stalls its OpenMP regions (a descheduled
    thread holds up every barrier), which on a small machine swamps what is being measured."""
    return max(1, (os.cpu_count() or 1) - 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--levels", default=None, help="comma-separated concurrency levels")
    p.add_argument("--repeats", default=None,
                   help="timed waves per side, one number or one per level (default 3,2,2)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--client", choices=("httpx", "openai"), default="httpx",
                   help="httpx (lightest on a small machine) or the official AsyncOpenAI")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="a fixed KV pool for both engines (a GPU shared by the two: each "
                        "would size its pool from what the other left)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of the checkpoint's shapes (a config-only folder "
                        "on a GPU; the accelerator comes from DEEPINFER_ACCELERATOR)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the offline engine and of the server's rank "
                        "(DEEPINFER_CPU_THREADS; default: all cores but one)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the server's streams are spread over (one Python "
                        "client saturates its core at a few hundred streams)")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="the server's --api-server-count (API processes on the port)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the server's --stream-interval (tokens a streamed chunk gathers)")
    p.add_argument("--profile", action="store_true",
                   help="py-spy the API process during one extra wave at the top level")
    p.add_argument("--model", default=None, help="an HF folder (default: embedded SmolLM2)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    base = QUICK if args.quick else Sizes()
    levels = tuple(int(x) for x in args.levels.split(",")) if args.levels else base.levels
    if args.repeats:
        reps = [int(x) for x in args.repeats.split(",")]
        reps = reps * len(levels) if len(reps) == 1 else reps
    elif levels == base.levels:
        reps = list(base.repeats)
    else:
        reps = [1] * len(levels)
    if len(reps) != len(levels):
        p.error("--repeats needs one number or one per level")
    args.sizes = Sizes(levels, args.prompt_len or base.prompt_len,
                       args.output_len or base.output_len, tuple(reps))
    if max(levels) > args.max_num_seqs:
        p.error("a level above --max-num-seqs would queue on both sides; raise --max-num-seqs")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # the server, with the engine trace installed at import
        from deepinfer.serve.cli import main as serve_main

        return serve_main(argv[1:])
    args = parse_args(argv)
    sizes: Sizes = args.sizes
    threads = args.threads or default_threads()
    # The same number of torch threads for the offline engine and the server's rank process.
    os.environ["DEEPINFER_CPU_THREADS"] = str(threads)
    if args.model:
        model_dir = args.model
    else:
        from deepinfer.models.default_model import ensure_default_model

        model_dir = ensure_default_model(progress=False)
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    os.makedirs(args.out, exist_ok=True)
    server_log = os.path.join(tempfile.gettempdir(), f"serve_overhead-{port}.log")
    log(f"model {model_dir}; {threads} torch threads; {sizes}; client {args.client}")
    t_start = time.perf_counter()
    trace_dir = tempfile.mkdtemp(prefix="serve-overhead-trace-")
    proc = start_server(model_dir, port, args, server_log, trace_dir)
    clients = None
    try:
        if args.client_procs > 1:
            import multiprocessing

            clients = ClientProcesses(
                multiprocessing.get_context("spawn").Pool(args.client_procs), args.client_procs)
        from deepinfer import LLM

        # Loads while the server starts; both engines take the same scheduler settings.
        llm = LLM(model=model_dir, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  load_format=args.load_format, num_blocks=args.num_kv_blocks,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        vocab = llm.engine.model.vocab_size
        wait_healthy(proc, base, server_log)
        import httpx

        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        meter = CpuMeter(proc.pid)
        log(f"server up on {base} ({time.perf_counter() - t_start:.0f} s)")

        # Warm-up, untimed: a few requests through both, so first-call costs are not measured.
        warm = random_prompts(4, sizes.prompt_len, vocab, seed=12345)
        offline_wave(llm, warm, min(8, sizes.output_len), 0, 0, meter)
        server_wave(base, name, warm, min(8, sizes.output_len), 0, 0, args.client, meter,
                    trace_dir, clients)
        log(f"warmed up ({time.perf_counter() - t_start:.0f} s)")
        # Before each timed wave, one short untimed request through the same side: the two
        # processes share one GPU, and the first step after the other process had used it
        # ran 3-20 ms slower, which at one stream is 1-4% of a wave and fell on whichever
        # side came second.
        primers = {"offline": lambda: offline_wave(llm, warm[:1], 2, 0, 0, meter),
                   "server": lambda: server_wave(base, name, warm[:1], 2, 0, 0, args.client,
                                                 meter, trace_dir, None)}

        waves: list[Wave] = []
        for level, reps in zip(sizes.levels, sizes.repeats):
            for rep in range(reps):
                prompts = random_prompts(level, sizes.prompt_len, vocab, seed=1000 * level + rep)
                runs = [("offline", lambda: offline_wave(llm, prompts, sizes.output_len, level,
                                                         rep, meter)),
                        ("server", lambda: server_wave(base, name, prompts, sizes.output_len,
                                                       level, rep, args.client, meter,
                                                       trace_dir, clients))]
                if rep % 2:
                    runs.reverse()  # alternate who goes first
                for side, run in runs:
                    primers[side]()
                    w = run()
                    waves.append(w)
                    log(f"  C={level:<3d} rep {rep} {side:7s} {w.wall_s:6.1f} s "
                        f"{w.output_tok_s:7.1f} tok/s  "
                        f"TTFT p50 {percentile(w.ttft_s, 50) * 1e3:7.0f} ms"
                        f"  ITL p50 {(percentile(w.itl_s, 50) or 0) * 1e3:6.1f} ms"
                        + (f"  API: request {percentile(w.request_path_s, 50) * 1e3:.1f} ms, token "
                           f"{percentile(w.token_path_s, 50) * 1e3:.2f} ms (p50)"
                           if w.token_path_s and w.request_path_s else "")
                        + f"  cpu {w.cpu}")
        profile = None
        if args.profile:
            level = max(sizes.levels)
            prompts = random_prompts(level, sizes.prompt_len, vocab, seed=999_999)
            est = max(w.wall_s for w in waves if w.side == "server" and w.level == level)
            log(f"profiling the API process for ~{est:.0f} s")
            profile = profile_api(proc.pid, est + 2, lambda: server_wave(
                base, name, prompts, sizes.output_len, level, -1, args.client, meter,
                trace_dir, clients))
        elapsed = time.perf_counter() - t_start
        env = environment(model_dir, threads, args.client, args.dtype)
        llm.engine.shutdown()
    except BaseException:
        _print_tail(server_log)  # what the server saw of a failed wave
        raise
    finally:
        if clients is not None:
            clients.pool.terminate()
        stop_server(proc)
        shutil.rmtree(trace_dir, ignore_errors=True)

    rows = summarize(waves, sizes.levels)
    report = {
        "benchmark": "serve_overhead",
        "environment": env,
        "sizes": {"levels": list(sizes.levels), "prompt_len": sizes.prompt_len,
                  "output_len": sizes.output_len, "repeats": list(sizes.repeats),
                  "quick": args.quick},
        "settings": {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens,
                     "kv_cache_memory_gb": args.kv_cache_memory_gb, "torch_threads": threads,
                     "load_format": args.load_format, "num_kv_blocks": args.num_kv_blocks,
                     "client_procs": args.client_procs, "stream_interval": args.stream_interval,
                     "api_server_count": args.api_server_count,
                     "prefix_cache": "off per request (and every prompt differs)"},
        "elapsed_s": round(elapsed, 1),
        "method": {
            "wave": "C requests submitted at once; offline: engine.add_request x C at t0 then "
                    "step() until done, tokens timestamped when step() returns; server: C "
                    "concurrent streaming POST /v1/completions (token-id prompt, greedy, "
                    "ignore_eos, prefix_cache false, keep-alive connections opened before the "
                    "wave), tokens timestamped when the client reads their SSE chunk",
            "ttft": "submit -> first token, per request; p50/p99 over all requests of all waves",
            "itl": "gaps between consecutive tokens of a request; p50/p99 over all gaps",
            "output_tok_s": "output tokens of the wave / wall time; median over waves",
            "ratio": "server / offline (TTFT, ITL: above 1 is slower; tok/s: below 1 is slower)",
            "order": "per repeat both sides once, the first side alternating; one untimed "
                     "warm-up wave of 4 short requests per side",
            "api_latency": "server only: the server runs with a hook (this file, imported by "
                           "its rank process) that timestamps Engine.add_request and each "
                           "token's Engine.step return; request path = client submit -> "
                           "add_request, token path = step return -> client read the SSE chunk "
                           "(perf_counter = CLOCK_MONOTONIC, shared by all processes)",
            "cpu_s": "CPU seconds during a wave: api = the deepinfer-serve process, rank = its "
                     "engine process(es), bench = this process (the offline engine or the "
                     "HTTP clients), other = everything else on the machine (noise)",
        },
        "summary": rows,
        "waves": [w.as_dict() for w in waves],
        "api_profile": profile,
    }
    json_path = write_json(os.path.join(args.out, "serve_overhead.json"), report)
    png_path = os.path.join(args.out, "serve_overhead.png")
    plot(rows, png_path, env, sizes)
    print(table(rows))
    if profile and "top_self_pct" in profile:
        print(f"\nAPI process during a C={max(sizes.levels)} wave (py-spy, {profile['samples']} "
              f"on-CPU samples, on CPU {profile['on_cpu_fraction']:.0%} of the wave); "
              "self time, % of on-CPU samples:")
        for frame, pct in profile["top_self_pct"][:15]:
            print(f"  {pct:5.1f}%  {frame}")
    print(f"wrote {json_path} and {png_path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
