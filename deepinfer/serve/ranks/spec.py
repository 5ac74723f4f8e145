"""A rank's spec: what the API process tells a rank process it is and where it talks."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.core.config import EngineConfig
from deepinfer.core.hicache.shared_pool import SharedPoolPlace
from deepinfer.serve.ranks.stream_pacing import DEFAULT_STREAM_INTERVAL


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    config: EngineConfig
    # One of each per API process (--api-server-count), process 0 first: each PUSHes its
    # requests to its input address and reads its results at its output address.
    input_addrs: tuple[str, ...]
    output_addrs: tuple[str, ...]
    heartbeat_interval_s: float = 0.5
    log_level: str = "INFO"
    # Set before anything else in the rank (the backend's AcceleratorInfo.rank_env): e.g. the
    # NeuronCores this rank owns, which its runtime reads once, when the backend starts it.
    env: dict[str, str] = field(default_factory=dict)
    # Tokens a sample gathers before they are sent (stream_pacing.py).
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    # A replacement joining a running expert-parallel group: the surviving rank whose expert
    # placement it takes (ParallelContext.placement_from). None at a group's first start.
    placement_from: int | None = None
    # The node's shared HiCache host pool (serve/ranks/node_pool.py); None: a pool per rank.
    shared_host_pool: SharedPoolPlace | None = None


def regroups(config: EngineConfig, num_ranks: int) -> bool:
    """A rank of this expert-parallel group that dies is replaced while the others keep their
    model (a regroup): only where one API process owns every rank of the group, as it alone
    sees the death and tells the others. Across hosts the whole group restarts."""
    parallel = config.parallel
    return parallel.ep and 1 < parallel.world_size == num_ranks
