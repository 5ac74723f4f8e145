"""Environment switches as frozen dataclasses: each field names its variable, its default and how
its text parses, so a backend's settings module is one table that docs/configuration.md and
tests/test_settings.py can read back.

    @dataclass(frozen=True)
    class CudaSettings:
        gemv: bool = setting(True, "DEEPINFER_CUDA_GEMV", flag)

    CudaSettings.from_env()  ->  read_settings(CudaSettings, os.environ)

An unset or empty variable keeps the field's default; a malformed one is a ValueError that names
the variable and its text.
"""
from __future__ import annotations

import os
from dataclasses import Field, field, fields
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(text: str) -> bool:
    """1/0, true/false, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")
    return value in _TRUE


def setting(default: Any, env: str, parse: Callable[[str], Any] = str) -> Any:
    """A dataclass field overridden by the environment variable `env`."""
    return field(default=default, metadata={"env": env, "parse": parse})


def read_settings(cls: type[T], environ: Mapping[str, str] | None = None) -> T:
    """An instance of the settings dataclass `cls` from `environ` (default: this process's)."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in env_fields(cls):
        text = environ.get(f.metadata["env"], "").strip()
        if text:
            values[f.name] = _parsed(f.metadata["env"], f.metadata["parse"], text)
    return cls(**values)


def env_fields(cls: type) -> list[Field]:
    """The fields of `cls` that an environment variable sets."""
    return [f for f in fields(cls) if "env" in f.metadata]


def env_names(cls: type) -> list[str]:
    return [f.metadata["env"] for f in env_fields(cls)]


def _parsed(name: str, parse: Callable[[str], Any], text: str) -> Any:
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from None
