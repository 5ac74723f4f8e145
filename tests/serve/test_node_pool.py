"""The server's folder for the node's shared HiCache pool (serve/ranks/node_pool.py): made only
where ranks share a pool, removed at stop, and a folder a killed server left is removed at the
next start while a live server's is kept."""
from __future__ import annotations

import os

import pytest

from deepinfer.core.config import CacheConfig
from deepinfer.serve.ranks import node_pool
from deepinfer.serve.ranks.node_pool import PREFIX, make_node_pool, place, remove_node_pool

pytestmark = pytest.mark.skipif(not os.path.isdir(node_pool.SHM_DIR), reason="no /dev/shm")

ON = CacheConfig(hicache_size_gb=1.0)


@pytest.mark.parametrize("cache,ranks", [
    (ON, 1),  # one rank: nothing to share
    (CacheConfig(), 2),  # HiCache off
    (CacheConfig(hicache_size_gb=1.0, hicache_shared=False), 2),  # --no-hicache-shared
    (CacheConfig(hicache_size_gb=1.0, enable_prefix_caching=False), 2),
])
def test_no_folder_where_nothing_is_shared(cache, ranks):
    assert make_node_pool(cache, ranks) is None
    assert place(None, ranks, 0) is None


def test_a_folder_per_server_and_stale_ones_removed():
    dead = os.path.join(node_pool.SHM_DIR, f"{PREFIX}{2 ** 22 + 7}-stale")  # no such pid
    os.makedirs(dead)
    with open(os.path.join(dead, "pages"), "wb") as f:
        f.write(b"\0" * 16)
    path = make_node_pool(ON, 2)
    try:
        assert path is not None and os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-")
        assert not os.path.exists(dead), "a gone server's pool was kept"
        node_pool.remove_stale_pools()
        assert os.path.isdir(path), "a live server's pool was removed"
        spot = place(path, 2, 1)
        assert (spot.path, spot.num_ranks, spot.rank) == (path, 2, 1)
    finally:
        remove_node_pool(path)
    assert not os.path.exists(path)
