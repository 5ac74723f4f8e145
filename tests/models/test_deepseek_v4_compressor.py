"""DeepSeek-V4's compressors and Lightning indexer run chunk by chunk over explicit state
(deepinfer/models/deepseek_v4/compressor.py) against transformers' own modules, driven
through their cache layers exactly as DeepseekV4Attention.forward drives them. The same
sequence goes in as one chunk, as random chunk splits and token by token after a prefix; every
chunk must emit the same compressed entries and index keys (values and entry numbers) and the
indexer must pick the same top-k entries per query (fp32, 1e-5). Our state goes through the
engine's fixed-size slot (pack/unpack) between chunks."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import DeepseekV4Config, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from deepinfer.models.deepseek_v4.compressor import (
    CSA,
    HCA,
    Compressor,
    build_compressor,
    index_scores,
    layer_cache_entries,
    layer_state_numel,
)

SEQ_LEN = 300
ATOL = 1e-5


def _config(hca_rate: int) -> DeepseekV4Config:
    # Layer 0 CSA (rate 4), layer 1 HCA; a YaRN "compress" rope as V4 checkpoints ship.
    return DeepseekV4Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.5, q_lora_rank=32, index_n_heads=8, index_head_dim=24,
        index_topk=8, o_groups=2, o_lora_rank=16, layer_types=[CSA, HCA],
        compress_rates={CSA: 4, HCA: hca_rate}, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 128})


def _attention(config: DeepseekV4Config, layer_idx: int) -> hf.DeepseekV4Attention:
    torch.manual_seed(layer_idx)
    attn = hf.DeepseekV4Attention(config, layer_idx).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return attn


@dataclass
class Step:
    entries: torch.Tensor  # all compressed entries of the sequence after this chunk
    keys: torch.Tensor | None  # all index keys (CSA)
    picks: torch.Tensor | None  # [n, k] indexer picks of the chunk's queries (CSA)
    scores: torch.Tensor | None = None  # [n, T] our index scores, to judge ties


def _q_residual(attn: hf.DeepseekV4Attention, h: torch.Tensor) -> torch.Tensor:
    return attn.q_a_norm(attn.q_a_proj(h))  # modeling_deepseek_v4.py:827


@torch.no_grad()
def _reference(config: DeepseekV4Config, attn: hf.DeepseekV4Attention, hidden: torch.Tensor,
               splits: list[int]) -> list[Step]:
    layer_idx, csa = attn.layer_idx, attn.layer_type == CSA
    cache = DynamicCache(config=config)  # DeepseekV4Model.forward :1343 (V4's cache layers)
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    picks: list[torch.Tensor] = []
    if csa:  # the indexer's top-k, which the compressor turns into a block bias (:703-712)
        attn.compressor.indexer.register_forward_hook(lambda m, a, out: picks.append(out))
    steps, p0 = [], 0
    for n in splits:
        h = hidden[None, p0:p0 + n]
        position_ids = torch.arange(p0, p0 + n)[None]  # :1347-1349
        cos, sin = rotary(h, position_ids=position_ids, layer_type="compress")  # :1365
        q_residual = _q_residual(attn, h)  # :827
        kv = attn.kv_norm(attn.kv_proj(h)).view(1, n, -1, attn.head_dim).transpose(1, 2)  # :832
        kv = hf.apply_rotary_pos_emb(kv, cos, sin)  # :833
        cache.update(kv, kv, layer_idx)  # :835-836, the sliding-window branch
        compressed_kv, _ = attn.compressor(h, q_residual, position_ids, cache, layer_idx)  # :840
        keys = cache.layers[layer_idx].compressed_kv["indexer"] if csa else None
        steps.append(Step(compressed_kv[0, 0].clone(), None if keys is None else keys[0].clone(),
                          picks[-1][0].clone() if csa else None))
        p0 += n
    return steps


@torch.no_grad()
def _ours(config: DeepseekV4Config, attn: hf.DeepseekV4Attention, hidden: torch.Tensor,
          splits: list[int], pack: bool) -> list[Step]:
    comp = build_compressor(config, attn.layer_type)
    comp.load_state_dict(attn.compressor.state_dict())
    csa = attn.layer_type == CSA
    state = comp.initial_state(torch.float32)
    istate = comp.indexer.initial_state(torch.float32) if csa else None
    entries, keys, steps, p0 = [], [], [], 0
    for n in splits:
        h, positions = hidden[p0:p0 + n], torch.arange(p0, p0 + n)
        state = _step(comp, h, p0, state, entries, pack)
        step = Step(torch.cat(entries), None, None)
        if csa:
            istate = _step(comp.indexer, h, p0, istate, keys, pack)
            step.keys = torch.cat(keys)
            q_residual = _q_residual(attn, h[None])[0]
            step.picks = comp.indexer.select(h, q_residual, positions, step.keys)
            q, w = comp.indexer.queries(h, q_residual, positions)
            step.scores = index_scores(q, w, positions, step.keys, comp.rate,
                                       comp.indexer.softmax_scale)
        steps.append(step)
        p0 += n
    return steps


def _step(comp: Compressor, h: torch.Tensor, p0: int, state, out: list, pack: bool):
    compressed, state = comp(h, p0, state)
    first = sum(e.shape[0] for e in out)
    assert compressed.indices.tolist() == list(range(first, first + compressed.entries.shape[0]))
    out.append(compressed.entries)
    if pack:  # through the engine's fixed-size state slot
        flat = comp.pack_state(state)
        assert flat.numel() == comp.state_numel
        state = comp.unpack_state(flat.clone(), p0 + h.shape[0])
    return state


def _assert_same_picks(ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor) -> None:
    """Same set of picks per query (and the same -1 count). topk's order among equal scores
    is unspecified, so where the sets differ the differing picks must tie in score."""
    assert ours.shape == ref.shape
    o, r = ours.sort(-1).values, ref.sort(-1).values
    for row in (o != r).any(-1).nonzero().flatten().tolist():
        assert (o[row] < 0).sum() == (r[row] < 0).sum()
        so = scores[row, o[row][o[row] >= 0]].sort().values
        sr = scores[row, r[row][r[row] >= 0]].sort().values
        torch.testing.assert_close(so, sr, atol=ATOL, rtol=0)


def _splits(kind: str, rng: random.Random) -> list[int]:
    if kind == "one_chunk":
        return [SEQ_LEN]
    if kind == "token_by_token":
        return [131] + [1] * (SEQ_LEN - 131)
    sizes, left = [], SEQ_LEN
    while left:
        sizes.append(min(left, rng.choice([1, 2, 3, 5, 7, 13, 17, 40, 64, 130])))
        left -= sizes[-1]
    return sizes


@pytest.fixture(scope="module")
def hidden() -> torch.Tensor:
    return torch.randn(SEQ_LEN, 64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["one_chunk", "random_0", "random_1", "token_by_token"])
@pytest.mark.parametrize("layer_type,hca_rate", [(CSA, 128), (HCA, 16), (HCA, 128)])
def test_matches_transformers(hidden, kind, layer_type, hca_rate):
    config = _config(hca_rate)
    attn = _attention(config, config.layer_types.index(layer_type))
    splits = _splits(kind, random.Random(kind))
    ref = _reference(config, attn, hidden, splits)
    ours = _ours(config, attn, hidden, splits, pack=kind != "one_chunk")
    rate = config.compress_rates[layer_type]
    assert ours[-1].entries.shape[0] == SEQ_LEN // rate
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.entries, r.entries, atol=ATOL, rtol=ATOL)
        if layer_type == CSA:
            torch.testing.assert_close(o.keys, r.keys, atol=ATOL, rtol=ATOL)
            _assert_same_picks(o.picks, r.picks, o.scores)


def test_state_slot_sizes_and_pages():
    config = DeepseekV4Config()  # V4-Flash dims: head_dim 512, index_head_dim 128, rates 4/128
    assert layer_state_numel(config, HCA) == 2 * 127 * 512
    assert layer_state_numel(config, CSA) == (2 * 3 * 1024 + 2 * 4 * 512) + (2 * 3 * 256
                                                                             + 2 * 4 * 128)
    assert layer_state_numel(config, "sliding_attention") == 0
    assert [e.entries_per_block(128) for e in layer_cache_entries(config, CSA)] == [32, 32, 1]
    assert [e.entries_per_block(128) for e in layer_cache_entries(config, HCA)] == [1]


@torch.no_grad()
def test_page_end_rows_resume_like_the_state(hidden):
    """page_end_rows (what a CSA layer writes into its page_state entry) as of position 128,
    from a chunk that starts inside a window, resumes the sequence as the carried state does."""
    config = _config(128)
    comp = build_compressor(config, CSA)
    comp.load_state_dict(_attention(config, 0).compressor.state_dict())
    full, _ = comp(hidden, 0, comp.initial_state(torch.float32))
    _, mid = comp(hidden[:126], 0, comp.initial_state(torch.float32))
    chunk = hidden[126:130]
    rows = comp.page_end_rows(mid, comp.kv_proj(chunk), comp.gate_proj(chunk), [128])
    assert rows.shape == (1, comp.page_state_numel)
    rest, _ = comp(hidden[128:], 128, comp.resume_state(rows[0], 128))
    torch.testing.assert_close(rest.entries, full.entries[32:], atol=0, rtol=0)


@torch.no_grad()
def test_page_boundary_snapshot_resumes(hidden):
    """A state packed at a 128-token boundary (what HiCache stores beside the pages) resumes
    the sequence exactly; its open windows are empty, only the Ca rows are live."""
    config = _config(128)
    comp = build_compressor(config, CSA)
    comp.load_state_dict(_attention(config, 0).compressor.state_dict())
    full, state = comp(hidden, 0, comp.initial_state(torch.float32))
    _, snap = comp(hidden[:128], 0, comp.initial_state(torch.float32))
    assert snap.tail_kv.shape[0] == 0 and snap.prev_kv is not None
    resumed = comp.unpack_state(comp.pack_state(snap).clone(), 128)
    rest, end = comp(hidden[128:], 128, resumed)
    torch.testing.assert_close(rest.entries, full.entries[32:], atol=0, rtol=0)
    assert rest.indices.tolist() == list(range(32, SEQ_LEN // 4))
    with pytest.raises(ValueError):
        comp(hidden[:1], 127, resumed)


def test_long_chunks_select_in_blocks_of_queries(monkeypatch):
    """The indexer's picks of a chunk too long for one score tensor, block by block of
    queries: the same picks."""
    from deepinfer.models.deepseek_v4 import attention
    from deepinfer.models.deepseek_v4.compressor import select_topk

    g = torch.Generator().manual_seed(3)
    q, w, keys = (torch.randn(*s, generator=g) for s in ((11, 2, 8), (11, 2), (7, 8)))
    positions = torch.arange(20, 31)
    whole = select_topk(q, w, positions, keys, 4, 3, 0.5)
    monkeypatch.setattr(attention, "MAX_SCORES", 3 * 2 * 7)
    assert torch.equal(select_topk(q, w, positions, keys, 4, 3, 0.5), whole)
