"""Helpers shared by the benchmark scripts in this folder.

The scripts are run as `python benchmarks/X.py`, which puts this folder on `sys.path`, so they
import this module as `common`. Kept free of heavy imports at module level (psutil, httpx and
matplotlib are imported where used), so `--help` stays fast.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")


def log(message: str) -> None:
    """Progress to stderr (stdout is kept for the result tables)."""
    print(message, file=sys.stderr, flush=True)


# ---- statistics ----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default); None if
    empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def exposed_by_name(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the time its intervals (start, end, name) add to the union of all of them,
    taken in start order: what each kernel adds to a step's critical path. Under PDL a kernel
    starts while the one ahead runs and waits for it, so its own duration overstates it; the
    part of it past every earlier kernel's end is what the step pays. The values sum to the
    union's length (the time anything ran)."""
    out: dict[str, float] = {}
    end = float("-inf")
    for lo, hi, name in sorted(spans):
        out[name] = out.get(name, 0.0) + max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return out


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` uniform random ids; ids below 100 (SmolLM2's special tokens)
    are skipped, and every prompt differs, so nothing is shared between them."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def save_word_tokenizer(path: str, vocab_size: int, eos_token_id: int) -> None:
    """A word-level tokenizer over ids t0..t{vocab_size-1} into `path` (no hub here), so that a
    server can stream text for a config-only model (--load-format dummy)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                           unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                                         eos_token=f"t{eos_token_id}").save_pretrained(path)


# ---- a deepinfer-serve subprocess ----------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], log_path: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr to `log_path` and `env` added to the environment
    (in `cwd`: `python -m` imports the package of the working directory first).

    Its own session, so SIGTERM reaches only the server (which stops its ranks itself)."""
    log_file = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True, env=dict(os.environ, **(env or {})))
    finally:
        log_file.close()  # the child holds its own copy of the descriptor


def wait_healthy(proc: subprocess.Popen, base: str, log_path: str,
                 timeout_s: float = 300.0) -> float:
    """Poll `{base}/health` until it answers 200; return the seconds it took.

    Raises RuntimeError (with the log's tail) if the server exits, TimeoutError after timeout_s."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"deepinfer-serve exited ({proc.returncode}):\n{tail}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"deepinfer-serve not healthy after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server; after 30 s, SIGKILL the session start_server made for it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


# ---- the machine ---------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def module_versions(names: tuple[str, ...], metadata: bool = False) -> dict[str, str | None]:
    """`__version__` of each module (or its installed distribution's version with
    `metadata=True`); None where it is absent, which is information too."""
    import importlib.metadata as md

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = md.version(name) if metadata else __import__(name).__version__
        except Exception:  # noqa: BLE001
            versions[name] = None
    return versions


def machine_environment() -> dict[str, Any]:
    """Date (UTC), CPU model, logical cores, memory and Python version, for a report."""
    import psutil

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "logical_cores": psutil.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version()}


# ---- output --------------------------------------------------------------------------------------
def write_json(path: str, obj: Any, indent: int = 2, **kwargs: Any) -> str:
    """Write `obj` as JSON to `path` (its folder is created) and return the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, **kwargs)
    return path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def peer_bars(path: str, result: dict, keys: list[str], labels: list[str], ylabel: str,
              title: str, ceiling: str = "roofline") -> None:
    """One group of bars per key: result["ceiling"], result["ours"] (DeepInfer) and
    result["hf"] (transformers) side by side, log scale, saved as a PNG at path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for k, (name, label) in enumerate((("ceiling", ceiling), ("ours", "DeepInfer"),
                                       ("hf", "transformers"))):
        values = [result[name].get(key, 0.0) for key in keys]
        ax.bar([i + (k - 1) * width for i in range(len(keys))], values, width, label=label)
    ax.set_xticks(range(len(keys)), labels)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def side_by_side(ax, labels: list[str], series: dict[str, list[float]]) -> None:
    """Bars of each series side by side at every label, with a legend."""
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(labels))], values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.legend(fontsize=8)


def replot(json_path: str, plot: Callable[[dict, str], None]) -> int:
    """Redraw a result's PNG beside its JSON (for --replot); the exit status."""
    with open(json_path) as f:
        result = json.load(f)
    plot(result, os.path.splitext(json_path)[0] + ".png")
    return 0
