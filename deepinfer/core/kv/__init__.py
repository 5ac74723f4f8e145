"""Paged KV bookkeeping: block pool, hash chain, per-request block manager."""
