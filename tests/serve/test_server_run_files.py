"""`deepinfer server` keeps each server's run files by port, under $DEEPINFER_CACHE_DIR/run, so a
second server's `stop` cannot reach the first. No model server: DEEPINFER_PYTHON is a wrapper
that runs a tiny /health server in place of `python -m deepinfer.serve.cli` (and is Python for
everything else server.sh runs)."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from conftest import free_port

from deepinfer.cli import script_args

FAKE_SERVE = """
import argparse, http.server
p = argparse.ArgumentParser()
p.add_argument("--port", type=int, default=8000)
args, _ = p.parse_known_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", args.port), Health).serve_forever()
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """HOME and DEEPINFER_CACHE_DIR in tmp_path; DEEPINFER_PYTHON the fake-serving wrapper."""
    (tmp_path / "fake_serve.py").write_text(FAKE_SERVE)
    wrapper = tmp_path / "python"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = -m ] && [ "$2" = deepinfer.serve.cli ]; then
            shift 2
            exec "{sys.executable}" "{tmp_path / 'fake_serve.py'}" "$@"
        fi
        exec "{sys.executable}" "$@"
        """))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    out = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    out.update(HOME=str(tmp_path / "home"), DEEPINFER_CACHE_DIR=str(tmp_path / "cache"),
               DEEPINFER_PYTHON=str(wrapper), DEEPINFER_START_TIMEOUT="30",
               DEEPINFER_STOP_TIMEOUT="5")
    return out


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", "server", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def _pid(pid_file: Path) -> int:
    return int(pid_file.read_text())


@contextlib.contextmanager
def _started(env: dict[str, str], port: int) -> Iterator[Path]:
    """A fake server on `port`; yields its run dir. Killed afterwards if the test left it."""
    started = _cli(env, "start", "--port", str(port), "--dp", "2")
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = Path(env["DEEPINFER_CACHE_DIR"]) / "run" / f"port-{port}"
    pid = _pid(run_dir / "server.pid")
    try:
        yield run_dir
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_two_servers_keep_their_own_run_files(env):
    port_a, port_b = free_port(), free_port()
    with _started(env, port_a) as dir_a, _started(env, port_b) as dir_b:
        pid_a, pid_b = _pid(dir_a / "server.pid"), _pid(dir_b / "server.pid")
        assert pid_a != pid_b and _running(pid_a) and _running(pid_b)
        assert (dir_a / "server.url").read_text().strip() == f"http://127.0.0.1:{port_a}"
        assert (dir_b / "server.log").exists()
        assert not (Path(env["HOME"]) / ".cache").exists()  # DEEPINFER_CACHE_DIR, not ~

        status_b = _cli(env, "status", "--port", str(port_b))
        assert status_b.returncode == 0 and f"pid {pid_b}" in status_b.stdout
        stopped = _cli(env, "stop", "--port", str(port_a))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not _running(pid_a) and not (dir_a / "server.pid").exists()
        assert _running(pid_b)  # the other server is untouched
        assert _cli(env, "status", "--port", str(port_a)).returncode == 3
        assert _cli(env, "status", "--port", str(port_b)).returncode == 0

        bare = _cli(env, "stop")  # port 8000: nothing there; names the port that has a server
        assert bare.returncode == 0 and f"port(s) {port_b}" in bare.stdout
        assert _running(pid_b)
        assert _cli(env, "stop", "--port", str(port_b)).returncode == 0
        assert not _running(pid_b)


def test_explicit_run_dir_is_one_server_and_refuses_another_port(env, tmp_path):
    env = dict(env, DEEPINFER_RUN_DIR=str(tmp_path / "run"))
    port, other = free_port(), free_port()
    started = _cli(env, "start", f"--port={port}")
    assert started.returncode == 0, started.stdout + started.stderr
    pid = _pid(tmp_path / "run" / "server.pid")
    try:
        assert _cli(env, "status", "--port", str(other)).returncode == 3
        assert "left alone" in _cli(env, "stop", "--port", str(other)).stdout
        assert _running(pid)
        assert _cli(env, "status").returncode == 0  # no --port: the folder's server
        assert _cli(env, "stop").returncode == 0
        assert not _running(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_stop_and_status_take_only_port():
    assert script_args("stop", []) == []
    assert script_args("status", ["--port", "9001"]) == ["--port", "9001"]
    assert script_args("start", ["--port", "9001", "--dp", "2"]) == ["--port", "9001", "--dp", "2"]
    with pytest.raises(SystemExit):
        script_args("stop", ["--model", "x"])
