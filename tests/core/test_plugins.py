"""Plugin discovery and backend selection: broken plugins are reported, never fatal."""
from __future__ import annotations

import argparse
import textwrap

import pytest
import torch

from deepinfer.cli import main
from deepinfer.core.accelerator import Accelerator
from deepinfer.core.config import ENV_ACCELERATOR
from deepinfer.core.plugins import (
    AcceleratorError,
    AcceleratorInfo,
    PluginRegistry,
    describe,
    hookimpl,
    load_plugins,
    select_accelerator,
)


@pytest.fixture(autouse=True)
def no_env_choice(monkeypatch):
    monkeypatch.delenv(ENV_ACCELERATOR, raising=False)


def fake_accelerator(name: str, available: bool = True) -> type[Accelerator]:
    class Fake(Accelerator):
        @classmethod
        def is_available(cls) -> bool:
            return available

        @classmethod
        def unavailable_reason(cls) -> str:
            return f"no {name} device"

        def load_model(self, spec): ...
        def num_kv_blocks(self, cache): return 2
        def allocate_kv_cache(self, num_blocks, block_size): ...
        def execute(self, batch): raise NotImplementedError

    Fake.name = Fake.__name__ = Fake.__qualname__ = name
    return Fake


def info(name: str, priority: int, available: bool = True, **kwargs) -> AcceleratorInfo:
    cls = fake_accelerator(name, available)
    kwargs.setdefault("load", lambda: cls)
    return AcceleratorInfo(name=name, priority=priority, **kwargs)


def failing_load() -> type[Accelerator]:
    raise ImportError("libfoo.so: cannot open shared object file")


class Backends:
    """A plugin object announcing the given backends."""

    def __init__(self, *infos: AcceleratorInfo) -> None:
        self.infos = list(infos)

    @hookimpl
    def deepinfer_register_accelerators(self) -> list[AcceleratorInfo]:
        return self.infos


def registry_with(*infos: AcceleratorInfo) -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(Backends(*infos), name="fakes")
    return registry


def test_builtin_cpu_backend_and_llama_models_are_registered():
    from deepinfer.backends.cpu.accelerator import CPUAccelerator

    registry = load_plugins()
    assert select_accelerator(registry, "CPU") is CPUAccelerator
    assert select_accelerator(registry) is CPUAccelerator
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.models.registry import model_class

    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert model_class(arch) is LlamaForCausalLM
    # Built-in models are registered once, in models/registry.py; plugins add theirs.
    assert "LlamaForCausalLM" not in registry.models()


def test_probe_takes_highest_priority_available_backend():
    registry = registry_with(
        info("low", 1), info("gone", 20, load=failing_load), info("absent", 10, available=False),
        info("mid", 5))
    assert select_accelerator(registry).__name__ == "mid"
    assert [f.name for f in registry.failures] == ["gone"]  # reported, not fatal
    rows = describe(registry)
    assert [r.name for r in rows] == ["gone", "absent", "mid", "low"]
    assert [r.status for r in rows[1:]] == ["unavailable", "available", "available"]
    assert rows[1].why_unavailable == "no absent device"  # the backend's own reason
    assert rows[0].status.startswith("failed: ImportError: libfoo.so")


def test_names_and_aliases_match_case_insensitively(monkeypatch):
    registry = registry_with(info("cpu", 0), info("fastgpu", 10, aliases=("nvidia", "cuda")))
    assert select_accelerator(registry, "CUDA").__name__ == "fastgpu"
    monkeypatch.setenv(ENV_ACCELERATOR, "Nvidia")
    assert select_accelerator(registry).__name__ == "fastgpu"
    assert select_accelerator(registry, "cpu").__name__ == "cpu"  # the argument beats the env


def test_unknown_name_lists_available_backends_and_failures():
    registry = registry_with(info("cpu", 0), info("gone", 3, load=failing_load))
    describe(registry)
    registry.report("otherplugin", "ModuleNotFoundError: No module named 'x'")
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'") as err:
        select_accelerator(registry, "tpu")
    assert "available: cpu, gone" in str(err.value)
    assert "otherplugin: ModuleNotFoundError" in str(err.value)


def test_requested_backend_that_fails_to_load_raises_with_its_reason(monkeypatch):
    registry = registry_with(info("cpu", 0), info("gone", 3, load=failing_load))
    monkeypatch.setenv(ENV_ACCELERATOR, "gone")
    with pytest.raises(AcceleratorError, match="'gone' failed to load: ImportError: libfoo.so"):
        select_accelerator(registry)


def test_requested_backend_that_is_unavailable_raises():
    registry = registry_with(info("cpu", 0), info("absent", 3, available=False))
    with pytest.raises(AcceleratorError,
                       match="'absent' is not available on this machine: no absent device"):
        select_accelerator(registry, "absent")


def test_no_available_backend_raises():
    registry = registry_with(info("absent", 3, available=False))
    with pytest.raises(AcceleratorError, match="no accelerator is available"):
        select_accelerator(registry)


def test_hook_that_raises_is_reported_and_others_still_load():
    class Raises:
        @hookimpl
        def deepinfer_register_accelerators(self):
            raise RuntimeError("plugin bug")

    registry = registry_with(info("cpu", 0))
    registry.register(Raises(), name="raises")
    assert [i.name for i in registry.accelerators()] == ["cpu"]
    assert registry.failures[0].name == "raises"
    assert "RuntimeError: plugin bug" in registry.failures[0].error


def test_duplicate_backend_name_is_reported():
    registry = registry_with(info("cpu", 0))
    registry.register(Backends(info("CPU", 9)), name="impostor")
    assert len(registry.accelerators()) == 1
    assert [f.name for f in registry.failures] == ["impostor"]


def test_config_hooks_reach_plugins():
    seen = []

    class Configures:
        @hookimpl
        def deepinfer_add_cli_args(self, parser):
            parser.add_argument("--fast-mode", action="store_true")

        @hookimpl
        def deepinfer_engine_started(self, config):
            seen.append(("started", config))

        @hookimpl
        def deepinfer_engine_stopped(self, config):
            seen.append(("stopped", config))

    registry = PluginRegistry()
    registry.register(Configures())
    parser = argparse.ArgumentParser()
    registry.add_cli_args(parser)
    assert parser.parse_args(["--fast-mode"]).fast_mode
    registry.engine_started("cfg")
    registry.engine_stopped("cfg")
    assert seen == [("started", "cfg"), ("stopped", "cfg")]


@pytest.fixture
def installed_broken_plugins(tmp_path, monkeypatch):
    """A distribution on sys.path whose entry points are broken in two ways: one module fails to
    import, one announces a backend whose load() raises."""
    (tmp_path / "di_test_import_fails.py").write_text("raise ImportError('needs libbar')\n")
    (tmp_path / "di_test_load_fails.py").write_text(textwrap.dedent("""
        from deepinfer.core.plugins import AcceleratorInfo, hookimpl

        def _load():
            raise ModuleNotFoundError("No module named 'vendor_sdk'")

        @hookimpl
        def deepinfer_register_accelerators():
            return [AcceleratorInfo(name="vendor", priority=50, load=_load)]
        """))
    dist = tmp_path / "di_test_broken_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: di-test-broken-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[deepinfer]\nimportfails = di_test_import_fails\nloadfails = di_test_load_fails\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_broken_entry_points_do_not_break_startup(installed_broken_plugins, monkeypatch):
    from deepinfer.backends.cpu.accelerator import CPUAccelerator

    registry = load_plugins()
    assert select_accelerator(registry) is CPUAccelerator
    failures = {f.name: f.error for f in registry.failures}
    assert failures["importfails"] == "ImportError: needs libbar"
    assert "vendor_sdk" in failures["vendor"]
    status = {r.name: r.status for r in describe(registry)}
    assert status["cpu"] == "available"
    assert status["vendor"] == "failed: ModuleNotFoundError: No module named 'vendor_sdk'"
    monkeypatch.setenv(ENV_ACCELERATOR, "vendor")
    with pytest.raises(AcceleratorError, match="'vendor' failed to load.*vendor_sdk"):
        select_accelerator(load_plugins())


def test_cli_lists_backends_and_failed_plugins(installed_broken_plugins, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:4] == ["cpu", "-", "0", "available"] for line in out.splitlines())
    assert "vendor" in out and "failed: ModuleNotFoundError" in out
    assert "importfails: ImportError: needs libbar" in out


def test_malformed_hook_results_are_reported():
    class Sloppy:
        @hookimpl
        def deepinfer_register_accelerators(self):
            return "cpu"

        @hookimpl
        def deepinfer_register_models(self):
            return ["LlamaForCausalLM"]

    registry = registry_with(info("cpu", 0, aliases=("fast",)), info("fast", 1))
    registry.register(Sloppy(), name="sloppy")
    assert select_accelerator(registry, "fast").__name__ == "fast"  # a name beats an alias
    assert registry.models() == {}
    assert {f.name for f in registry.failures} == {"sloppy"} and len(registry.failures) == 2


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch is installed")
def test_nvidia_on_a_cpu_torch_says_which_torch_to_install():
    registry = load_plugins()
    with pytest.raises(AcceleratorError, match="is a build without CUDA: install a CUDA build"):
        select_accelerator(registry, "nvidia")
