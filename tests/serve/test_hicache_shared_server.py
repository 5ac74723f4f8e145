"""The node's shared HiCache pool through `deepinfer-serve --dp 2`: a prompt one rank computed is
a host hit on the other rank (same tokens); a rank SIGKILLed while it holds pool pages (its
write-back to disk, throttled, still reading them) costs nothing: the other rank serves on,
the pool's pinned count returns to 0, the restarted rank finds the node's pages (a host hit
on its empty device), and the pool's shared-memory folder goes with the server."""
from __future__ import annotations

import glob
import os
import random
import signal

import httpx
from conftest import ServerProcess, make_tiny_chat_checkpoint, scrape, wait_until

from deepinfer.serve.ranks.node_pool import PREFIX, SHM_DIR

BLOCK = 16
PROMPT_TOKENS = 300  # 18 full pages
KEEP = 140  # yoco_keep_tokens' default: a host hit leaves at least these to recompute


def _complete(server: ServerProcess, prompt: list[int], session: str) -> tuple[dict, int]:
    """A greedy completion routed by its session key; the answer and the rank that served."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0,
                   headers={"X-Session-Affinity": session})
    assert r.status_code == 200, r.text
    return r.json(), int(r.headers["x-deepinfer-rank"])


def _session_on(server: ServerProcess, rank: int) -> str:
    """A session key affinity routing sends to `rank` (a one-token probe per candidate)."""
    for i in range(64):
        _, served = _complete(server, [5, 6, 7], f"probe-{i}")
        if served == rank:
            return f"probe-{i}"
    raise AssertionError(f"no session key routes to rank {rank}")


def _pinned(server: ServerProcess) -> float:
    return scrape(server.url)["deepinfer:hicache_pages_pinned"]


def _rank(server: ServerProcess, rank: int) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()["ranks"][rank]


def test_ranks_share_one_pool_and_a_killed_rank_leaks_nothing(tmp_path):
    (tmp_path / "ckpt").mkdir()
    ckpt = make_tiny_chat_checkpoint(str(tmp_path / "ckpt"))
    args = ["--model", ckpt, "--served-model-name", "tiny", "--dtype", "float32",
            "--block-size", str(BLOCK), "--num-kv-blocks", "64", "--max-num-seqs", "4",
            "--dp", "2", "--hicache-size-gb", "0.01",
            "--hicache-disk-dir", str(tmp_path / "disk"),
            # ~50 KB/s: the prompt's 18 pages of 8 KB take ~3 s to write back, and a page
            # stays pinned in the pool until it is written.
            "--hicache-disk-write-mb-s", "0.05"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    server = ServerProcess("hicache-shared", args, str(tmp_path / "server.log"), "tiny")
    server.start()
    try:
        server.wait_ready()
        pools = glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{server.proc.pid}-*"))
        assert len(pools) == 1 and os.path.exists(os.path.join(pools[0], "pages"))
        others = {rank: _session_on(server, rank) for rank in (0, 1)}

        first, writer = _complete(server, prompt, others[0])
        answer = first["choices"][0]["token_ids"]
        # Rank 1 never saw the prompt: what it reuses comes from the pool rank 0 filled.
        second, reader = _complete(server, prompt, others[1])
        assert (writer, reader) == (0, 1)
        assert second["choices"][0]["token_ids"] == answer
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (PROMPT_TOKENS - KEEP) // BLOCK * BLOCK, cached

        # Rank 0's write-back still holds the prompt's pages when it is killed.
        wait_until(lambda: _pinned(server) > 0, 10.0, "pinned pages in the pool")
        pid = _rank(server, 0)["pid"]
        os.kill(pid, signal.SIGKILL)
        again, served = _complete(server, prompt, others[1])  # the peer serves on
        assert served == 1 and again["choices"][0]["token_ids"] == answer
        wait_until(lambda: _pinned(server) == 0, 30.0, "the dead rank's pins to be released")
        # The restarted rank 0 maps the same pool: its first request hits the node's pages.
        wait_until(lambda: _rank(server, 0)["pid"] != pid and
                   _rank(server, 0)["state"] == "serving", 120.0, "rank 0 to be back")
        back, served = _complete(server, prompt, others[0])
        assert served == 0 and back["choices"][0]["token_ids"] == answer
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        wait_until(lambda: _pinned(server) == 0, 30.0, "no pinned page at the end")
    finally:
        server.terminate()
        problems = server.finish_stop()
    assert not problems, "\n".join(problems)
    assert not os.path.exists(pools[0]), "the pool's shared memory outlived the server"
