"""Every stream holds a socket: a server started under a low open-file limit (256 here, as
1,024 is on many machines) raises it itself, so 400 concurrent streams all finish instead of
some being refused or cut (httpx.ReadError) once the API process runs out of descriptors."""
from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys

import httpx
import pytest
from conftest import TINY_BLOCK_SIZE, free_port, wait_until

STREAMS = 400
SOFT_LIMIT = 256


def _low_file_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_LIMIT, hard))


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> str:
    body = {"model": "tiny-chat", "prompt": [1 + i % 50, 5, 7, 9], "max_tokens": 4,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks, tokens, done = 0, 0, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"error"' not in line:
                    chunk = json.loads(line[len("data: "):])
                    chunks += bool(chunk["choices"])
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                done |= line == "data: [DONE]"
    except httpx.HTTPError as exc:
        return type(exc).__name__
    # A stream the API process fell behind gets the tokens it missed in one chunk (coalesce).
    return "ok" if done and tokens == 4 and 1 <= chunks <= 4 else f"{chunks} chunks, {tokens}"


async def _wave(url: str) -> list[str]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, url, i) for i in range(STREAMS)))


def test_a_low_open_file_limit_does_not_drop_streams(module_servers, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * STREAMS:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise")
    if soft < 2 * STREAMS:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))  # the client's own
    port, log = free_port(), open(tmp_path / "server.log", "w")
    env = dict(os.environ, DEEPINFER_CPU_THREADS="1", TOKENIZERS_PARALLELISM="false")
    server = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--model",
         module_servers._tiny_checkpoint(), "--served-model-name", "tiny-chat",
         "--block-size", str(TINY_BLOCK_SIZE), "--num-kv-blocks", str(STREAMS + 16),
         "--max-num-seqs", str(STREAMS), "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_low_file_limit)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert server.poll() is None, open(tmp_path / "server.log").read()[-3000:]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(healthy, 240, "the server")
        outcomes = asyncio.run(_wave(url))
        assert outcomes.count("ok") == STREAMS, sorted(set(outcomes))
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        log.close()
