"""The example third-party plugin (examples/plugin), when installed, is discovered through its
entry point and passes the conformance suite. CI installs it with `pip install ./examples/plugin`."""
import importlib.metadata

import pytest

from deepinfer.core.config import ENV_ACCELERATOR
from deepinfer.core.plugins import describe, load_plugins, select_accelerator
from deepinfer.testing.conformance import run_conformance

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
    run_conformance(select_accelerator(load_plugins(), "example"), str(tmp_path))
