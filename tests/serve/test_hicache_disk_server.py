"""HiCache's disk tier through `deepinfer-serve`: a server killed with SIGKILL while it writes
pages back, then started again over the same folder, serves the prompt's pages from disk with
the tokens of the first answer; a page corrupted on disk meanwhile is caught by its checksum
(counted, recomputed), and what the killed writes left is removed."""
from __future__ import annotations

import os
import random
import signal

import httpx
from conftest import ServerProcess, descendants, make_tiny_chat_checkpoint, scrape, wait_until

from deepinfer.core.hicache import disk as disk_module

BLOCK = 16
PROMPT_TOKENS = 300  # 18 full pages


def _complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    return r.json()


def _page_file(disk_dir: str, tokens: list[int]) -> str | None:
    """The page file holding these tokens, if it is on disk whole."""
    for folder, _, names in os.walk(disk_dir):
        for name in names:
            path = os.path.join(folder, name)
            try:  # a temporary file may be renamed or removed meanwhile
                page_bytes = os.path.getsize(path) - disk_module._HEADER.size - 8 * BLOCK
            except FileNotFoundError:
                continue
            read = disk_module._read_header(path, page_bytes)
            if read is not None and read[1].tokens == tuple(tokens):
                return path
    return None


def test_a_killed_server_restarts_onto_its_disk_pages(tmp_path):
    (tmp_path / "ckpt").mkdir()
    ckpt = make_tiny_chat_checkpoint(str(tmp_path / "ckpt"))
    disk_dir = str(tmp_path / "disk")
    args = ["--model", ckpt, "--served-model-name", "tiny", "--dtype", "float32",
            "--block-size", str(BLOCK), "--num-kv-blocks", "64", "--max-num-seqs", "4",
            "--hicache-size-gb", "0.01", "--hicache-disk-dir", disk_dir, "--hicache-disk-gb", "1",
            # ~50 KB/s: the 18 pages of 8 KB take ~3 s to write back, so the kill comes
            # while most of them are queued or being written.
            "--hicache-disk-write-mb-s", "0.05"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    pages = [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(4)]

    first = ServerProcess("disk-first", args, str(tmp_path / "first.log"), "tiny")
    first.start()
    try:
        first.wait_ready()
        answer = _complete(first, prompt)["choices"][0]["token_ids"]
        # Killed as soon as the first pages are on disk: the later ones are still queued or
        # being written, and nothing gets to finish.
        wait_until(lambda: all(_page_file(disk_dir, p) for p in pages), 30.0,
                   "the prompt's first pages on disk", poll_s=0.01)
        victims = [first.proc.pid, *descendants(first.proc.pid)]
        on_disk = sum(_page_file(disk_dir, prompt[i * BLOCK:(i + 1) * BLOCK]) is not None
                      for i in range(PROMPT_TOKENS // BLOCK))
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        assert on_disk < PROMPT_TOKENS // BLOCK  # the kill came during write-back
        wait_until(lambda: not any(os.path.exists(f"/proc/{p}") and
                                   open(f"/proc/{p}/stat").read().split()[2] not in "ZX"
                                   for p in victims), 10.0, "the killed processes to end")
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
        first._log.close()

    corrupt = _page_file(disk_dir, pages[2])
    with open(corrupt, "r+b") as f:  # a flipped bit in page 2's bytes
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    stray = corrupt + ".tmp999-1"  # what a write cut short leaves
    with open(stray, "wb") as f:
        f.write(b"\x00" * 100)

    second = ServerProcess("disk-second", args, str(tmp_path / "second.log"), "tiny")
    second.start()
    try:
        second.wait_ready()
        assert not os.path.exists(stray)
        again = _complete(second, prompt)
        assert again["choices"][0]["token_ids"] == answer
        # Pages 0 and 1 came from disk; page 2 failed its checksum: the hit ends there.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
        metrics = scrape(second.url)
        assert metrics["deepinfer:hicache_disk_corrupt_pages_total"] == 1
        assert metrics["deepinfer:hicache_disk_read_pages_total"] >= 2
        assert metrics["deepinfer:hicache_disk_write_stopped"] == 0
        second.wait_idle()
        wait_until(lambda: scrape(second.url)["deepinfer:hicache_disk_write_queue"] == 0, 30.0,
                   "the write-back queue to drain")
    finally:
        second.terminate()
        problems = second.finish_stop()
    assert not problems, "\n".join(problems)
    # The recomputed page was written back whole.
    assert _page_file(disk_dir, pages[2]) is not None
