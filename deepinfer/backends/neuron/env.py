"""Per-rank NeuronCore setup: the cores each rank process of `deepinfer-serve --dp N` owns, and
the Neuron runtime settings it starts with, as environment variables.

The runtime reads them when it initialises, and a NeuronCore reserved by one process cannot be
used by any other until that process exits: so every rank gets its own contiguous range, set in
the rank process before the backend is imported (AcceleratorInfo.rank_env, serve/ranks/entry.py).
Core indices are logical NeuronCores (on trn2 with NEURON_LOGICAL_NC_CONFIG=2, a trn2.48xlarge
shows 64 of them, 128 with 1).

Runtime variables set here, and where they are documented:
- NEURON_RT_VISIBLE_CORES, NEURON_RT_EXEC_TIMEOUT, NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS:
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/nrt-configurable-parameters.html
- NEURON_RT_ROOT_COMM_ID (rank 0's ip:port, mandatory for collectives), and the rule that a
  visible range must be contiguous and increasing: the runtime developer guide,
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/guides/nrt-developer-guide.html
  (source: github.com/aws-neuron/aws-neuron-sdk, neuron-runtime/guides/nrt-developer-guide.rst)
- Implicit async mode removed in Neuron 2.31 (the variable now only warns):
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/announcements/neuron2.x/announce-no-support-implicit-async-mode.html
- NEURON_LOGICAL_NC_CONFIG:
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/logical-neuroncore-config.html
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from deepinfer.core.settings import flag, read_settings, setting

VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"
LOGICAL_NC_CONFIG = "NEURON_LOGICAL_NC_CONFIG"
ROOT_COMM_ID = "NEURON_RT_ROOT_COMM_ID"
EXEC_TIMEOUT = "NEURON_RT_EXEC_TIMEOUT"
# 0 disables the runtime's implicit async execution (its documented default; set anyway so that
# an inherited value cannot turn it on). Runtime 2.31 removed that mode and only warns about the
# variable. No documented runtime variable turns off a speculative lookahead, so basic mode
# sets this one alone.
ASYNC_INFLIGHT = "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"


DEVICE_KINDS = ("auto", "neuron", "xla", "cpu")
# Capacity per expert slot = factor x the mean routes per slot: 2x absorbs ordinary router skew;
# a heavier hot expert costs a dense rerun of its layer, never a dropped token.
DEFAULT_CAPACITY_FACTOR = 2.0


def _device_kind(text: str) -> str:
    kind = text.strip().lower()
    if kind not in DEVICE_KINDS:
        raise ValueError(f"expected one of {', '.join(DEVICE_KINDS)}")
    return kind


def positive_factor(text: str) -> float:
    factor = float(text)
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"expected a positive number, the capacity per expert slot as a "
                         f"multiple of its mean load (default {DEFAULT_CAPACITY_FACTOR})")
    return factor


@dataclass(frozen=True)
class NeuronSettings:
    """The backend's own switches (the runtime's per-rank ones are NeuronRankSetup's)."""

    # auto: TorchNeuron, else torch-neuronx; cpu: the static graphs on the host.
    device: str = setting("auto", "DEEPINFER_NEURON_DEVICE", _device_kind)
    # The grouped expert path's capacity factor (a step that would overflow reruns dense).
    moe_capacity: float = setting(DEFAULT_CAPACITY_FACTOR, "DEEPINFER_NEURON_MOE_CAPACITY",
                                  positive_factor)
    # Time attention, router exchange, experts and combine at the graph-split boundaries.
    region_timing: bool = setting(False, "DEEPINFER_NEURON_REGION_TIMING", flag)
    # On the xla device: check every step against its plan (xla_audit.py) and raise on a
    # compilation after start-up or a host sync inside a step.
    audit_graphs: bool = setting(False, "DEEPINFER_NEURON_AUDIT_GRAPHS", flag)


def neuron_settings(environ: Mapping[str, str] | None = None) -> NeuronSettings:
    """The switches from `environ` (default: this process's environment)."""
    return read_settings(NeuronSettings, environ)


@dataclass(frozen=True)
class NeuronRankSetup:
    """How the NeuronCores of this host are split over its ranks, and the runtime's settings."""

    cores_per_rank: int = setting(0, "DEEPINFER_NEURON_CORES_PER_RANK", int)  # 0: even share
    total_cores: int = setting(0, "DEEPINFER_NEURON_TOTAL_CORES", int)  # 0: the visible ones
    # trn2: 1 or 2 (None: the runtime's default, 2 on trn2)
    logical_nc_config: int | None = setting(None, "DEEPINFER_NEURON_LOGICAL_NC_CONFIG", int)
    root_comm: str = setting("", "DEEPINFER_NEURON_ROOT_COMM", str)  # host:port of rank 0
    exec_timeout_s: int | None = setting(None, "DEEPINFER_NEURON_EXEC_TIMEOUT_S", int)
    basic_mode: bool = setting(False, "DEEPINFER_NEURON_BASIC_MODE", flag)  # no async exec

    def __post_init__(self) -> None:
        if self.cores_per_rank < 0 or self.total_cores < 0:
            raise ValueError("cores_per_rank and total_cores must be >= 0 (0: automatic)")
        if self.logical_nc_config not in (None, 1, 2):
            raise ValueError(f"logical_nc_config must be 1 or 2, got {self.logical_nc_config}")
        if self.exec_timeout_s is not None and self.exec_timeout_s < 0:
            raise ValueError(f"exec_timeout_s must be >= 0, got {self.exec_timeout_s}")
        if self.root_comm:
            _check_address(self.root_comm)


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"root_comm must be host:port (rank 0's), got {address!r}")


def settings_from_env(environ: Mapping[str, str]) -> NeuronRankSetup:
    """The setup from DEEPINFER_NEURON_* variables; an unset or empty one keeps its default."""
    return read_settings(NeuronRankSetup, environ)


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES ("4", "0-3", "3-5,6") as sorted core indices."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        raise ValueError(f"{VISIBLE_CORES}={text!r} is not a list of cores and ranges") from None
    if len(set(cores)) != len(cores):
        raise ValueError(f"{VISIBLE_CORES}={text!r} has overlapping ranges")
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """A contiguous run of cores as the runtime takes it: "4" or "4-7"."""
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def _pool(setup: NeuronRankSetup, base_env: Mapping[str, str]) -> list[int] | None:
    """The cores this host's ranks share; None when their number is not known (every core)."""
    text = base_env.get(VISIBLE_CORES, "").strip()
    visible = parse_cores(text) if text else None
    if not setup.total_cores:
        return visible
    if visible is None:
        return list(range(setup.total_cores))
    if setup.total_cores > len(visible):
        raise ValueError(f"total_cores={setup.total_cores} is more than the {len(visible)} cores "
                         f"of {VISIBLE_CORES}={text}")
    return visible[:setup.total_cores]


def _per_rank(setup: NeuronRankSetup, pool: list[int] | None, world_size: int) -> int | None:
    """Cores per rank: as set, else an even share of the pool; None: one rank takes them all."""
    if setup.cores_per_rank:
        return setup.cores_per_rank
    if pool is None:
        if world_size == 1:
            return None
        raise ValueError(f"splitting the NeuronCores over {world_size} ranks needs their count: "
                         f"set DEEPINFER_NEURON_CORES_PER_RANK, DEEPINFER_NEURON_TOTAL_CORES "
                         f"or {VISIBLE_CORES}")
    if len(pool) < world_size:
        raise ValueError(f"{world_size} ranks need a NeuronCore each, only {len(pool)} visible")
    return len(pool) // world_size


def rank_cores(setup: NeuronRankSetup, rank: int, world_size: int,
               base_env: Mapping[str, str]) -> list[int] | None:
    """The cores rank `rank` of `world_size` owns (exclusive, contiguous); None: all of them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    pool = _pool(setup, base_env)
    per_rank = _per_rank(setup, pool, world_size)
    if per_rank is None:
        return None
    if pool is None:  # their count is unknown: a range past the last core fails at nrt_init
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    if world_size * per_rank > len(pool):
        raise ValueError(f"{world_size} ranks x {per_rank} NeuronCores need "
                         f"{world_size * per_rank}, only {len(pool)} available")
    cores = pool[rank * per_rank:(rank + 1) * per_rank]
    if cores[-1] - cores[0] != len(cores) - 1:
        raise ValueError(f"rank {rank}'s NeuronCores {cores} are not one contiguous range "
                         f"(the runtime needs one)")
    return cores


def rank_env(setup: NeuronRankSetup, rank: int, world_size: int,
             base_env: Mapping[str, str]) -> dict[str, str]:
    """The Neuron runtime variables of rank `rank` of `world_size`, over the inherited
    `base_env` (only read). Pure: the same arguments give the same variables."""
    env: dict[str, str] = {}
    cores = rank_cores(setup, rank, world_size, base_env)
    if cores is not None:
        env[VISIBLE_CORES] = format_cores(cores)
    if setup.logical_nc_config is not None:
        env[LOGICAL_NC_CONFIG] = str(setup.logical_nc_config)
    if setup.root_comm:
        env[ROOT_COMM_ID] = setup.root_comm
    if setup.exec_timeout_s is not None:
        env[EXEC_TIMEOUT] = str(setup.exec_timeout_s)
    if setup.basic_mode:
        env[ASYNC_INFLIGHT] = "0"
    return env


def plugin_rank_env(rank: int, world_size: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """AcceleratorInfo.rank_env of the neuron backend: the setup read from `base_env`; nothing
    when its graphs run on the host (DEEPINFER_NEURON_DEVICE=cpu: no NeuronCores to split)."""
    if neuron_settings(base_env).device == "cpu":
        return {}
    return rank_env(settings_from_env(base_env), rank, world_size, base_env)


def use_compile_cache(environ: MutableMapping[str, str] | None = None) -> None:
    """torch-neuronx keeps compiled graphs (NEFFs) in its on-disk Neuron Persistent Cache, set
    with NEURON_CC_FLAGS=--cache_dir (Neuron docs, "Neuron Persistent Cache"): ours goes under
    DEEPINFER_CACHE_DIR, so a restart loads every bucket instead of compiling it again. Set
    before torch_xla is imported; a --cache_dir the user gave wins."""
    from deepinfer.core.config import cache_dir

    environ = os.environ if environ is None else environ
    flags = environ.get("NEURON_CC_FLAGS", "")
    if "--cache_dir" not in flags:
        where = os.path.join(cache_dir(), "neuron-compile-cache")
        environ["NEURON_CC_FLAGS"] = f"{flags} --cache_dir={where}".strip()
