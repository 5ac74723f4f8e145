"""A backend's host tier through the whole engine: a multi-turn conversation whose device pages
are evicted between turns must decode the same greedy tokens with HiCache on and off, with the
lost pages served from host memory. Used by the CPU tests and by the GPU check script."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from deepinfer.core.accelerator import Accelerator
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.hicache.cache import HiCacheStats
from deepinfer.core.hicache.disk import DiskStats
from deepinfer.core.hicache.shared_pool import SharedPoolPlace
from deepinfer.core.sampling import SamplingParams

BLOCK = 16
DEVICE_BLOCKS = 14  # 13 usable pages: one long prompt of another user evicts the conversation
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclass
class ConversationResult:
    outputs: list[list[int]]
    cached_tokens: list[int]
    stats: HiCacheStats | None
    disk: DiskStats | None = None


def make_engine(path: str, accelerator: Accelerator, host_pages: int,
                disk_dir: str | None = None, disk_pages: int = 1024,
                shared: SharedPoolPlace | None = None) -> Engine:
    from deepinfer.models.registry import kv_spec_of

    page_bytes = kv_spec_of(path).block_bytes(BLOCK, 4)  # float32
    config = EngineConfig(
        model=ModelSpec(path, "float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=DEVICE_BLOCKS, yoco_keep_tokens=8,
                          hicache_size_gb=host_pages * page_bytes / (1 << 30),
                          hicache_disk_dir=disk_dir,
                          hicache_disk_gb=disk_pages * (page_bytes + 512) / (1 << 30)),
        scheduler=SchedulerConfig(max_num_batched_tokens=256))
    return Engine(config, accelerator, load_tokenizer=False, shared_host_pool=shared)


def generate(engine: Engine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, GREEDY)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last


def conversation(engine: Engine | Sequence[Engine], vocab: int,
                 turns: int = 6) -> ConversationResult:
    """Each turn appends the previous answer and new user tokens; another user's long prompt
    runs between turns and takes the device pool, evicting earlier turns. Given several
    engines (ranks), turn t runs on engine t mod their number."""
    engines = [engine] if isinstance(engine, Engine) else list(engine)
    rng = random.Random(0)
    convo = [rng.randrange(2, vocab) for _ in range(40)]
    outputs, cached = [], []
    for turn in range(turns):
        engine = engines[turn % len(engines)]
        out = generate(engine, f"t{turn}", convo)
        outputs.append(list(out.token_ids))
        cached.append(out.num_cached_tokens)
        generate(engine, f"other{turn}", [rng.randrange(2, vocab) for _ in range(180)])
        convo = convo + list(out.token_ids) + [rng.randrange(2, vocab) for _ in range(12)]
    stats = engine.hicache.stats() if engine.hicache is not None else None
    return ConversationResult(outputs, cached, stats)


def check_host_tier(path: str, make_accelerator: Callable[[], Accelerator], vocab: int,
                    host_pages: int = 64) -> HiCacheStats:
    """Raise AssertionError unless the host tier changes nothing but where the hits come from."""
    off_engine = make_engine(path, make_accelerator(), host_pages=0)
    off = conversation(off_engine, vocab)
    off_engine.shutdown()
    on_engine = make_engine(path, make_accelerator(), host_pages)
    on = conversation(on_engine, vocab)
    assert on.outputs == off.outputs, "greedy tokens changed with the host tier on"
    stats = on.stats
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0, "no host-tier hit"
    assert sum(on.cached_tokens) > sum(off.cached_tokens), "the host tier served nothing"
    # The other users' random prompts hit nothing, so every hit belongs to the conversation.
    assert sum(on.cached_tokens) == stats.device_hit_tokens + stats.host_hit_tokens
    assert on_engine.hicache.pool.num_pinned == 0 and on_engine.kv.num_request_blocks() == 0
    on_engine.shutdown()
    return stats


def check_shared_pool(path: str, make_accelerator: Callable[[], Accelerator], vocab: int,
                      folder: str, host_pages: int = 64) -> list[HiCacheStats]:
    """Raise AssertionError unless two ranks sharing one host pool (`folder`) serve a
    conversation whose turns alternate between them with the tokens of a run with no cache,
    each turn after the first hitting the pages the other rank stored; nothing stays pinned.
    The ranks' stats, rank 0's first."""
    off_engine = make_engine(path, make_accelerator(), host_pages=0)
    off = conversation(off_engine, vocab)
    off_engine.shutdown()
    ranks = [make_engine(path, make_accelerator(), host_pages,
                         shared=SharedPoolPlace(folder, 2, rank)) for rank in range(2)]
    assert ranks[0].hicache is not None and ranks[0].hicache.stats().shared, "not shared"
    run = conversation(ranks, vocab)
    assert run.outputs == off.outputs, "greedy tokens changed with the shared pool"
    # Each turn's device pages are on the other rank: what it reuses comes from the pool.
    assert all(c > 0 for c in run.cached_tokens[1:]), run.cached_tokens
    stats = [engine.hicache.stats() for engine in ranks]
    assert all(s.host_hit_tokens > 0 for s in stats), "a rank hit nothing of the other's"
    assert stats[0].pages_total == 2 * host_pages and stats[0].pages_pinned == 0
    assert all(e.kv.num_request_blocks() == 0 for e in ranks)
    for engine in ranks:
        engine.shutdown()
    return stats


def check_disk_tier(path: str, make_accelerator: Callable[[], Accelerator], vocab: int,
                    disk_dir: str, host_pages: int = 64) -> list[ConversationResult]:
    """Raise AssertionError unless the disk tier changes nothing but where the hits come from:
    the conversation with host and disk tiers on, then again in a new engine (a restart: an
    empty device and host) over the same folder, decode the tokens of a run with no tier; the
    second run's first turn hits pages the first run wrote to disk."""
    off_engine = make_engine(path, make_accelerator(), host_pages=0)
    off = conversation(off_engine, vocab)
    off_engine.shutdown()
    runs = []
    for _ in range(2):
        engine = make_engine(path, make_accelerator(), host_pages, disk_dir)
        run = conversation(engine, vocab)
        assert run.outputs == off.outputs, "greedy tokens changed with the disk tier on"
        engine.hicache.poll(wait=True)
        assert engine.hicache.pool.num_pinned == 0 and engine.kv.num_request_blocks() == 0
        engine.shutdown()
        run.disk = engine.hicache.disk_stats()
        runs.append(run)
    first, restarted = runs
    assert first.disk.written_pages > 0 and first.disk.corrupt_pages == 0
    assert first.cached_tokens[0] == 0 and restarted.cached_tokens[0] > 0, \
        "the restarted engine's first turn was not served from disk"
    assert restarted.disk.read_pages > 0
    return runs
