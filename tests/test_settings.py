"""Environment switches live in one settings module per part of the package, and every one of
them is documented: a read anywhere else, or a variable docs/configuration.md does not name,
fails here."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from deepinfer.backends.cuda.settings import CudaSettings
from deepinfer.backends.neuron.env import NeuronRankSetup, NeuronSettings
from deepinfer.core.settings import env_names, flag, read_settings, setting
from deepinfer.serve.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepinfer"
SETTINGS_MODULES = {"core/config.py", "core/settings.py", "backends/cuda/settings.py",
                    "backends/neuron/env.py", "serve/settings.py"}
ENV_USE = re.compile(r"os\.environ|os\.getenv")
# Setting a variable for a child process or a library is not a read.
ENV_WRITE = re.compile(r"os\.environ(\[[^]]+\]\s*=[^=]|\.(setdefault|update|pop)\()"
                       r"|del os\.environ")


def _code(line: str) -> str:
    return line.split("#", 1)[0]


def test_the_environment_is_read_only_in_settings_modules():
    stray = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        if name in SETTINGS_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = _code(line)
            if ENV_USE.search(code) and not ENV_WRITE.search(code):
                stray.append(f"deepinfer/{name}:{number}: {line.strip()}")
    assert not stray, "read the environment through a settings module:\n" + "\n".join(stray)


def test_every_variable_is_documented():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    declared = {name for cls in (CudaSettings, NeuronSettings, NeuronRankSetup, ServeSettings)
                for name in env_names(cls)}
    literal = {m for path in PACKAGE.rglob("*.py")
               for m in re.findall(r"\bDEEPINFER_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    missing = sorted(name for name in declared | literal if f"`{name}`" not in docs)
    assert not missing, f"not in docs/configuration.md: {missing}"


@dataclass(frozen=True)
class _Example:
    on: bool = setting(True, "EXAMPLE_ON", flag)
    size: int = setting(4, "EXAMPLE_SIZE", int)


def test_settings_parse_and_name_the_variable_they_refuse():
    assert read_settings(_Example, {}) == _Example()
    assert read_settings(_Example, {"EXAMPLE_ON": "off", "EXAMPLE_SIZE": " 8 "}) == \
        _Example(False, 8)
    assert read_settings(_Example, {"EXAMPLE_SIZE": ""}).size == 4  # empty: the default
    with pytest.raises(ValueError, match="EXAMPLE_ON='maybe'"):
        read_settings(_Example, {"EXAMPLE_ON": "maybe"})
    with pytest.raises(ValueError, match="EXAMPLE_SIZE='x'"):
        read_settings(_Example, {"EXAMPLE_SIZE": "x"})
    assert read_settings(CudaSettings, {"DEEPINFER_CUDA_GEMV": "0"}).gemv is False
