"""The example third-party plugin (examples/plugin), when installed, is discovered through its
entry point and passes the conformance suite on every KV shape. CI installs it with
`pip install ./examples/plugin`."""
import importlib.metadata

import pytest

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.torch.ops import ReferenceOps
from deepinfer.core.accelerator import Accelerator
from deepinfer.core.config import ENV_ACCELERATOR
from deepinfer.core.plugins import describe, load_plugins, select_accelerator
from deepinfer.testing.conformance import KV_SHAPES, run_conformance

try:
    importlib.metadata.distribution("deepinfer-example-plugin")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("deepinfer-example-plugin is not installed (pip install ./examples/plugin)",
                allow_module_level=True)


def test_example_plugin_is_discovered_and_never_wins_the_probe(monkeypatch):
    monkeypatch.delenv(ENV_ACCELERATOR, raising=False)
    registry = load_plugins()
    rows = {row.name: row for row in describe(registry)}
    assert rows["example"].status == "available" and rows["example"].priority < 0
    assert select_accelerator(registry).name == "cpu"
    assert select_accelerator(registry, "counting").name == "example"


def test_example_plugin_passes_conformance(tmp_path):
    backend = select_accelerator(load_plugins(), "example")
    # Written as a third-party backend is: on the public Accelerator and runner, not by
    # subclassing a built-in backend.
    assert issubclass(backend, Accelerator) and not issubclass(backend, CPUAccelerator)
    from deepinfer_example_plugin.ops import ExampleOps

    assert issubclass(ExampleOps, ReferenceOps) and not issubclass(ExampleOps, CPUOps)
    run_conformance(backend, str(tmp_path), shapes=KV_SHAPES)
