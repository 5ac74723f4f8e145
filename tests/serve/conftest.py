"""Real `deepinfer-serve` processes for the API tests, driven over HTTP.

Servers are started once per session as `python -m deepinfer.serve.cli ...` on free localhost
ports, waited on through /health (bounded), and stopped with SIGTERM at the end of the session.
Stopping checks that the server exits cleanly and that every process it started (the rank
processes, multiprocessing's resource tracker) is gone too, so nothing leaks.

These servers exist, each started only when a test module that needs it first runs, together
with the module's other servers so that their (CPU-bound) start-ups overlap; once started, a
server serves the later modules of the session too. Under pytest-xdist every worker has its own
session: a worker starts only the servers its own modules need.

* `tiny`: a random-weight 2-layer llama with the SmolLM2 tokenizer and chat template, block size
  16 and only 64 KV blocks (so leaked blocks would soon starve it). Before it is stopped the
  session checks that it is idle: no running request and no KV block in use.
* `auth`: the same checkpoint, started with --api-key.
* `smol`: the embedded default model (SmolLM2-135M-Instruct, no --model) for end-to-end checks.
* `dp2`: the `tiny` server's checkpoint and flags with `--dp 2` (two rank processes, affinity
  routing), for data-parallel routing; it must be left idle too.
* `tools`: the `tiny` server's weights and tokenizer with a Hermes-style chat template that
  renders tools, tool calls and tool results itself (tests/checkpoints.py), and room for the
  longer prompts that tools make, for agent frameworks as clients; it must be left idle too.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import httpx
import pytest

START_TIMEOUT_S = 240.0  # generous: on 2 busy cores three servers may start at once
STOP_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 20.0
TINY_NUM_KV_BLOCKS = 64
TINY_BLOCK_SIZE = 16
TINY_CONTEXT = 512
API_KEY = "test-secret-key"
TOOLS_CONTEXT = 2048
SERVER_FIXTURES = {"tiny_server": "tiny", "auth_server": "auth", "smol_server": "smol",
                   "dp2_server": "dp2", "tools_server": "tools"}
IDLE_CHECKED = ("tiny", "dp2", "tools")


# ---- process helpers (Linux /proc, so no psutil is needed) -----------------------------------
def _proc_state(pid: int) -> str | None:
    """The /proc state letter of `pid`, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]


def _alive(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z", "X")  # zombies have exited


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return [p for p in out if _alive(p)]


def wait_until(condition, timeout: float, what: str, poll_s: float = 0.05):
    """condition()'s first truthy value; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one server process ----------------------------------------------------------------------
@dataclass
class ServerProcess:
    name: str
    args: list[str]
    log_path: str
    model_name: str
    api_key: str | None = None
    port: int = 0
    proc: subprocess.Popen | None = None
    ready: bool = False
    children: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    _retried: bool = False
    _terminated: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> None:
        self.port = free_port()
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **self.env)
        # One compute thread per rank: several servers share few cores here, and oversubscribed
        # OpenMP threads spin-wait each other into ~10x slower steps.
        env.setdefault("DEEPINFER_CPU_THREADS", "1")
        command = [sys.executable, "-m", "deepinfer.serve.cli", "--host", "127.0.0.1",
                   "--port", str(self.port), "--log-level", "info", *self.args]
        if self.api_key:
            command += ["--api-key", self.api_key]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "<no log>"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        if self.ready:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log_tail().lower() and not self._retried:
                    self._retried = True  # lost a race for the free port: once more
                    self._log.close()
                    self.start()
                    continue
                pytest.fail(f"server {self.name} exited with {self.proc.returncode} during "
                            f"start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.ready = True
                    # Remember what it started now: after a SIGTERM the children would be
                    # re-parented and no longer found under the server.
                    self.children = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server {self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> dict[str, float]:
        """Poll /metrics until no request runs and no KV block is in use; return the gauges."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = scrape(self.url)
            running = gauges.get("vllm:num_requests_running", 0.0)
            waiting = gauges.get("vllm:num_requests_waiting", 0.0)
            usage = gauges.get("vllm:kv_cache_usage_perc", 0.0)
            if running == 0 and waiting == 0 and usage == 0:
                return gauges
            if time.monotonic() > deadline:
                raise AssertionError(f"server {self.name} not idle after {timeout}s: running="
                                     f"{running} waiting={waiting} kv_cache_usage={usage}")
            time.sleep(0.2)

    def terminate(self) -> None:
        """Send SIGTERM (noting the processes it started first); see finish_stop()."""
        if self.proc is not None and self.proc.poll() is None:
            self.children = sorted(set(self.children) | set(descendants(self.proc.pid)))
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def finish_stop(self) -> list[str]:
        """Wait for a terminated server; return the problems seen (not exiting, leaks)."""
        problems: list[str] = []
        if self.proc is None:
            return problems
        if not self._terminated:
            problems.append(f"server {self.name} died early with {self.proc.poll()}")
        else:
            try:
                code = self.proc.wait(timeout=STOP_TIMEOUT_S)
                if code != 0 and self.ready:  # a server still starting may die of SIGTERM
                    problems.append(f"server {self.name} exited with {code} after SIGTERM")
            except subprocess.TimeoutExpired:
                problems.append(f"server {self.name} ignored SIGTERM for {STOP_TIMEOUT_S}s")
                self.proc.kill()
                self.proc.wait(timeout=10)
            deadline = time.monotonic() + 15.0
            while any(_alive(p) for p in self.children) and time.monotonic() < deadline:
                time.sleep(0.1)
            leaked = [p for p in self.children if _alive(p)]
            for pid in leaked:
                try:
                    os.kill(pid, signal.SIGKILL)  # only processes this server started
                except ProcessLookupError:
                    pass
            if leaked and self.ready:
                problems.append(f"server {self.name} left child processes {leaked} running")
        self._log.close()
        if "Traceback (most recent call last)" in self.log_tail(chars=10**7):
            problems.append(f"server {self.name} logged a traceback")
        if problems:
            problems.append(f"log of {self.name}:\n{self.log_tail()}")
        return problems


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


@contextmanager
def served(name: str, args: list[str], log_dir, model_name: str) -> Iterator[ServerProcess]:
    """A server of a test module's own: started and ready, then stopped with nothing left
    behind (the stop's problems fail the test)."""
    proc = ServerProcess(name, args, str(log_dir / f"{name}.log"), model_name)
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()
        problems = proc.finish_stop()
        assert not problems, "\n".join(problems)


def scrape(url: str, path: str = "/metrics") -> dict[str, float]:
    """Prometheus text as {name: value}, label sets of one name summed."""
    text = httpx.get(f"{url}{path}", timeout=10.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape_series(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric `name` keyed by their sorted (label, value) pairs."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if m and m.group(1) == name:
            out[tuple(sorted(_LABEL_RE.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def per_rank(url: str, name: str, **match: str) -> dict[int, float]:
    """{rank: value} of a rank-labelled metric, over the samples whose labels match `match`."""
    out: dict[int, float] = {}
    for labels, value in scrape_series(url, name).items():
        d = dict(labels)
        if all(d.get(k) == v for k, v in match.items()):
            out[int(d["rank"])] = out.get(int(d["rank"]), 0.0) + value
    return out


# ---- the random-weight checkpoint ------------------------------------------------------------
def make_tiny_chat_checkpoint(path: str, context: int = TINY_CONTEXT,
                              chat_template: str | None = None) -> str:
    """A random 2-layer llama using the default model's tokenizer and chat template (or
    `chat_template` instead), of `context` positions."""
    import torch
    import transformers

    from deepinfer.models.default_model import ensure_default_model

    source = ensure_default_model(progress=False)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(source, name), path)
    if chat_template is not None:  # transformers reads chat_template.jinja before the config
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(chat_template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=context,
        initializer_range=0.1, bos_token_id=1, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


UNTRUSTED_MARKER = "encoding-py-ran"


def plant_untrusted_encoder(path: str) -> str:
    """An encoding.py in the folder that leaves UNTRUSTED_MARKER beside it if it is ever
    imported: the servers started without --trust-remote-code must never run it."""
    marker = os.path.join(path, UNTRUSTED_MARKER)
    with open(os.path.join(path, "encoding.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').write('ran')\n"
                "def encode_messages(messages, tools=None, **kw):\n"
                "    return 'PLANTED'\n")
    return path


# ---- fixtures --------------------------------------------------------------------------------
class ServerPool:
    def __init__(self, log_dir: str, tmp_path_factory) -> None:
        self.log_dir = log_dir
        self.tmp_path_factory = tmp_path_factory
        self.servers: dict[str, ServerProcess] = {}
        self._tiny_ckpt: str | None = None

    def launch(self, name: str, args: list[str], model_name: str,
               api_key: str | None = None) -> None:
        server = ServerProcess(name, args, os.path.join(self.log_dir, f"{name}.log"),
                               model_name, api_key)
        self.servers[name] = server
        server.start()

    def launch_wanted(self, wanted: set[str]) -> None:
        """Start every server in `wanted` that is not started yet, all at once."""
        wanted = wanted - set(self.servers)
        if "smol" in wanted:  # needs no checkpoint: start it first
            self.launch("smol", ["--block-size", "16", "--num-kv-blocks", "256",
                                 "--max-num-seqs", "4"], "SmolLM2-135M-Instruct")
        if "tools" in wanted:
            self.launch("tools", ["--model", self._tools_checkpoint(), "--block-size",
                                  str(TINY_BLOCK_SIZE), "--num-kv-blocks", "256",
                                  "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                  "--dtype", "float32", "--served-model-name", "tiny-tools"],
                        "tiny-tools")
        if not wanted & {"tiny", "auth", "dp2"}:
            return
        common = ["--model", self._tiny_checkpoint(), "--block-size", str(TINY_BLOCK_SIZE),
                  "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                  "--dtype", "float32", "--max-request-body-mb", "1"]
        if "tiny" in wanted:
            self.launch("tiny", common + ["--num-kv-blocks", str(TINY_NUM_KV_BLOCKS),
                                          "--served-model-name", "tiny-chat"], "tiny-chat")
        if "dp2" in wanted:  # as tiny, with two ranks: dp=2 must answer as dp=1 does,
            # also when the ranks step in lockstep over a torch.distributed group (--ep)
            self.launch("dp2", common + ["--num-kv-blocks", str(TINY_NUM_KV_BLOCKS),
                                         "--served-model-name", "tiny-chat", "--dp", "2",
                                         "--ep"], "tiny-chat")
        if "auth" in wanted:
            self.launch("auth", common + ["--num-kv-blocks", "32",
                                          "--served-model-name", "tiny-auth"], "tiny-auth",
                        api_key=API_KEY)

    def _tiny_checkpoint(self) -> str:
        if self._tiny_ckpt is None:
            self._tiny_ckpt = plant_untrusted_encoder(make_tiny_chat_checkpoint(
                str(self.tmp_path_factory.mktemp("tiny-chat"))))
        return self._tiny_ckpt

    def _tools_checkpoint(self) -> str:
        from checkpoints import HERMES_TOOL_TEMPLATE

        return make_tiny_chat_checkpoint(str(self.tmp_path_factory.mktemp("tiny-tools")),
                                         TOOLS_CONTEXT, HERMES_TOOL_TEMPLATE)

    def get(self, name: str) -> ServerProcess:
        server = self.servers[name]
        server.wait_ready()
        return server

    def stop_all(self) -> list[str]:
        problems = []
        for name in IDLE_CHECKED:
            server = self.servers.get(name)
            if server is not None and server.ready and server.proc.poll() is None:
                try:  # whatever the tests did, nothing may stay allocated
                    server.wait_idle()
                except AssertionError as exc:
                    problems.append(str(exc))
        for server in self.servers.values():  # stop them all at once, then wait
            server.terminate()
        for server in self.servers.values():
            problems += server.finish_stop()
        return problems


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    pool = ServerPool(str(tmp_path_factory.mktemp("serve-logs")), tmp_path_factory)
    try:
        yield pool
    finally:
        problems = pool.stop_all()
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def module_servers(request, server_pool) -> ServerPool:
    """The pool, with every server this module's tests need launched."""
    here = [item for item in request.session.items
            if getattr(item, "module", None) is request.module]
    server_pool.launch_wanted({SERVER_FIXTURES[f] for item in here
                               for f in getattr(item, "fixturenames", ())
                               if f in SERVER_FIXTURES})
    return server_pool


@pytest.fixture(scope="module")
def tiny_server(module_servers) -> ServerProcess:
    return module_servers.get("tiny")


@pytest.fixture(scope="module")
def auth_server(module_servers) -> ServerProcess:
    return module_servers.get("auth")


@pytest.fixture(scope="module")
def smol_server(module_servers) -> ServerProcess:
    return module_servers.get("smol")


@pytest.fixture(scope="module")
def dp2_server(module_servers) -> ServerProcess:
    return module_servers.get("dp2")


@pytest.fixture(scope="module")
def tools_server(module_servers) -> ServerProcess:
    return module_servers.get("tools")


def openai_client(server: ServerProcess, api_key: str = "unused", **kwargs):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0,
                         timeout=kwargs.pop("timeout", 120.0), **kwargs)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai_client(tiny_server)


@pytest.fixture(scope="module")
def smol_client(smol_server):
    return openai_client(smol_server)


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120.0) as c:
        yield c
