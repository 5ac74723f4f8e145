"""HiCache: a host-memory tier of KV pages (see cache.py), so a conversation's next turn
prefills only what it adds even after its device blocks were evicted."""
from deepinfer.core.hicache.cache import HiCache, HiCacheStats, HostHit
from deepinfer.core.hicache.pool import HostPage, HostPagePool

__all__ = ["HiCache", "HiCacheStats", "HostHit", "HostPage", "HostPagePool"]
