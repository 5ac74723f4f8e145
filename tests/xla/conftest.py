"""The XLA tests' device: PyTorch/XLA's CPU PJRT device, set before torch_xla is imported (the
servers these tests start inherit it). Its LLVM back end compiles unoptimised: the graphs,
their count and their results are the same, the compiles take half the time."""
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")


@pytest.fixture
def xla_device(monkeypatch):
    """The Neuron backend on the XLA device, every step audited against its plan."""
    monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "xla")
    monkeypatch.setenv("DEEPINFER_NEURON_AUDIT_GRAPHS", "1")


def pytest_collection_modifyitems(items) -> None:
    # scripts/test.sh runs these niced beside the main suite, on the cores it leaves idle.
    for item in items:
        item.add_marker(pytest.mark.timeout(1800))
