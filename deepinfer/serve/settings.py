"""The server's environment, in one place: the switches it reads (documented in
docs/configuration.md), the environment its rank and child processes inherit, and the variables
it sets for the libraries it loads. Imports nothing heavy: prometheus_client must not be loaded
before the metrics folder is named."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

from deepinfer.core.settings import read_settings, setting

# prometheus_client's multiprocess mode (several API processes): its folder of metric files.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# transformers' advice that PyTorch is missing, which the API process's torch-free import of
# its tokenizers would print although torch is installed.
_QUIET_TRANSFORMERS = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
# OpenMP's spin before a waiting thread sleeps, set in rank processes unless the user set it.
GOMP_SPINCOUNT_ENV = "GOMP_SPINCOUNT"


@dataclass(frozen=True)
class ServeSettings:
    api_key: str | None = setting(None, "DEEPINFER_API_KEY")  # the default of --api-key
    metrics_dir: str = setting("", MULTIPROC_ENV)  # set: metrics shared through files


def serve_settings() -> ServeSettings:
    return read_settings(ServeSettings)


def process_env() -> dict[str, str]:
    """A copy of this process's environment: what its rank and child processes inherit, and
    what backends split per rank (AcceleratorInfo.rank_env) and torchrun's variables are read
    from."""
    return dict(os.environ)


@contextlib.contextmanager
def metrics_dir_set(folder: str) -> Iterator[None]:
    """prometheus_client's multiprocess folder, for this process and the ones it starts."""
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield
    finally:
        os.environ.pop(MULTIPROC_ENV, None)


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' advisory warnings off for the moment, unless the user chose a value."""
    if _QUIET_TRANSFORMERS in os.environ:
        yield
        return
    os.environ[_QUIET_TRANSFORMERS] = "1"
    try:
        yield
    finally:
        os.environ.pop(_QUIET_TRANSFORMERS, None)


def enter_rank_env(env: dict[str, str], gomp_spincount: str) -> None:
    """A rank process's environment, set before torch or a backend is imported: the rank's
    own variables over the inherited ones, and OpenMP's spin unless the user set it."""
    os.environ.setdefault(GOMP_SPINCOUNT_ENV, gomp_spincount)  # read when torch loads libgomp
    os.environ.update(env)
