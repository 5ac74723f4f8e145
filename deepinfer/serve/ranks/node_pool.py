"""The folder in shared memory where the ranks of this node keep HiCache's node-wide host pool
(core/hicache/shared_pool.py): made before the ranks start, removed when the server stops, and
a folder a killed server left behind is removed at the next start."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from deepinfer.core.config import CacheConfig
from deepinfer.core.hicache.shared_pool import SharedPoolPlace, process_alive

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "deepinfer-hicache-"


def make_node_pool(cache: CacheConfig, num_ranks: int) -> str | None:
    """A fresh folder for the pool, or None where no pool is shared: one rank, HiCache off or
    per rank (--no-hicache-shared), or no shared-memory file system here."""
    if num_ranks < 2 or not cache.hicache_shared or cache.hicache_size_gb <= 0 \
            or not cache.enable_prefix_caching:
        return None
    if not os.path.isdir(SHM_DIR):
        log.warning("HiCache: no %s here; each rank keeps its own host pool", SHM_DIR)
        return None
    remove_stale_pools()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)


def place(path: str | None, num_ranks: int, rank: int) -> SharedPoolPlace | None:
    return None if path is None else SharedPoolPlace(path, num_ranks, rank)


def remove_node_pool(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_pools() -> None:
    """Folders of servers that are gone (named by their pid), e.g. killed with SIGKILL."""
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            log.info("HiCache: removing %s, left by a server that is gone", name)
            shutil.rmtree(os.path.join(SHM_DIR, name), ignore_errors=True)
