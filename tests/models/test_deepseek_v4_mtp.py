"""Speculative decoding with DeepSeek-V4's MTP layer as the draft, on the CPU backend.

The parity checkpoint (a sliding, a CSA and an HCA layer; real vocabulary) with an MTP layer
added (v4_mtp_checkpoints.py). Its random drafts are all rejected, so verify steps run rejected
drafts through the compressors and rewind them (rewind.py) all the time: outputs equal plain
decoding and transformers for k = 1..3. Drafts that are right, or right except for one
position, must change nothing either. The draft layer's logits equal a reference composed from
transformers' own decoder layer and hyper head, the way DeepSeek's release composes its
MTPBlock."""
from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
import transformers
from transformers.masking_utils import create_sliding_window_causal_mask

from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.models.oracle_drafts import OracleSpeculator, cpu_draft_logits, prefill_batch
from tests.models.test_deepseek_v4_parity import make_v4, prompts  # noqa: F401 (a fixture)
from tests.models.test_moe_parity import _assert_reference_greedy
from tests.models.v4_mtp_checkpoints import add_v4_mtp, grown_model, mtp_own

MTP_SEED = 5
N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    return add_v4_mtp(make_v4(str(tmp_path_factory.mktemp("v4_mtp"))), MTP_SEED)


def _llm(path: str, k: int, **options) -> LLM:
    """The default backend: cpu here; DEEPINFER_ACCELERATOR=nvidia on a GPU runs the same
    checks through the nvidia backend's graphs (benchmarks/cuda/run_device.sh v4_check)."""
    return LLM(path, dtype="float32", num_blocks=16, load_tokenizer=False,
               max_num_batched_tokens=48, num_speculative_tokens=k, **options)


@pytest.fixture(scope="module")
def plain(mtp_path, prompts, v4_reference) -> list[list[int]]:
    """Plain decoding's tokens, checked against transformers."""
    outs = [o.outputs[0].token_ids for o in _llm(mtp_path, 0).generate(prompts, GREEDY)]
    for prompt, out in zip(prompts, outs):
        _assert_reference_greedy(v4_reference, prompt, out)
    return outs


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_plain_decoding(mtp_path, prompts, plain, k):
    llm = _llm(mtp_path, k)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain
    stats = llm.engine.scheduler.spec_stats
    assert stats.draft_tokens > 40 * k  # every decode step verified k drafts
    kv = llm.engine.kv
    assert kv.num_request_blocks() == 0 and not kv._slots


@pytest.mark.parametrize("wrong", [None, 0, 1, 2])
def test_right_and_partly_right_drafts(mtp_path, prompts, plain, wrong):
    """Rejections after 0, 1 or 2 accepted drafts land at every offset inside the CSA
    windows (rate 4): the kept tail rows, the carry-over and the entries stay right."""
    llm = _llm(mtp_path, 3)
    outputs = {tuple(p): o for p, o in zip(prompts, plain)}
    acc = llm.engine.accelerator
    acc.speculator = OracleSpeculator(acc.speculator, outputs, wrong, 129280)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain
    stats = llm.engine.scheduler.spec_stats
    if wrong is None:
        assert stats.accepted_tokens == stats.draft_tokens > 0
    else:
        assert stats.accepted_per_position[wrong] == 0
        assert all(stats.accepted_per_position[j] > 0 for j in range(wrong))


def test_rewind_is_what_keeps_rejections_exact(mtp_path, prompts, plain, monkeypatch):
    """Without the rewind, rejected drafts that close a window corrupt the state."""
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    monkeypatch.setattr(DeepseekV4ForCausalLM, "rewind_carry", lambda *args: None)
    outs = [o.outputs[0].token_ids for o in _llm(mtp_path, 3).generate(prompts, GREEDY)]
    assert outs != plain


def test_draft_logits_match_a_transformers_built_reference(mtp_path, prompts):
    prompt, nxt = prompts[1][:70], 4242  # 70 tokens: several windows, CSA and HCA entries
    ours = cpu_draft_logits(mtp_path, prompt, nxt, 4, 128,
                            lambda spec: prefill_batch(prompt, [2], 128, spec, [0]),
                            state_slots=1)
    ref = _reference_draft_logits(mtp_path, prompt, nxt)
    assert (ours - ref).abs().max().item() < 1e-4


def _no_cache() -> dict:
    """The mask builder's cache argument: `cache` since transformers 5.2x, before that
    `past_key_values`."""
    params = inspect.signature(create_sliding_window_causal_mask).parameters
    return {"cache": None} if "cache" in params else {"past_key_values": None}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_draft_logits(path: str, prompt: list[int], nxt: int) -> torch.Tensor:
    """DeepSeek's MTPBlock over transformers' modules: the main model's streams before its
    hyper head (a hook), e_proj/h_proj over enorm/hnorm, transformers' decoder layer L of the
    model grown by it, a transformers hyper head with the MTP's own weights, the MTP's norm,
    the main LM head."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    main = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    grown = grown_model({k: v for k, v in config.items() if k != "num_nextn_predict_layers"},
                        MTP_SEED)
    own = mtp_own(config["hidden_size"], config["hc_mult"], MTP_SEED + 2)
    eps, n = config["rms_norm_eps"], len(prompt)
    captured = []
    hook = main.model.hc_head.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    with torch.no_grad():
        main(torch.tensor([prompt]))
        hook.remove()
        streams = captured[0]  # [1, n, N, H]
        embeds = main.model.embed_tokens(torch.tensor([prompt[1:] + [nxt]]))
        e = _rms(embeds, own["enorm.weight"], eps) @ own["e_proj.weight"].T
        x = _rms(streams, own["hnorm.weight"], eps) @ own["h_proj.weight"].T + e[:, :, None]
        positions = torch.arange(n)[None]
        mask = create_sliding_window_causal_mask(config=grown.config, inputs_embeds=embeds,
                                                 attention_mask=None, position_ids=positions,
                                                 **_no_cache())
        rotary = grown.model.rotary_emb
        embeddings = {label: rotary(embeds, position_ids=positions, layer_type=label)
                      for label in ("main", "compress")}
        out = grown.model.layers[config["num_hidden_layers"]](
            x, position_embeddings=embeddings, position_ids=positions, attention_mask=mask,
            input_ids=None, cache=None)
        head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(
            grown.config)
        head.load_state_dict({"hc_fn": own["hc_head_fn"], "hc_base": own["hc_head_base"],
                              "hc_scale": own["hc_head_scale"]})
        y = _rms(head(out)[0], own["norm.weight"], eps)
        return y @ main.lm_head.weight.T


def test_release_and_transformers_spellings_load_the_same_mtp(mtp_path, tmp_path):
    """The release's `mtp.0.attn.wq_a` / `hc_attn_fn` / `ffn.experts.{e}.w1` and transformers'
    module names under `mtp.0.` (packed experts) fill the same parameters."""
    from safetensors.torch import load_file

    from deepinfer.backends.cpu.ops import CPUOps
    from deepinfer.backends.torch.paged_cache import PagedCache
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.models.weights import iter_checkpoint

    config = transformers.AutoConfig.from_pretrained(mtp_path)
    layers = config.num_hidden_layers
    with open(os.path.join(mtp_path, "config.json")) as f:
        raw = json.load(f)
    raw.pop("num_nextn_predict_layers")
    block = {"mtp.0." + k.removeprefix(f"model.layers.{layers}."): v for k, v in
             grown_model(raw, MTP_SEED).state_dict().items()
             if k.startswith(f"model.layers.{layers}.")}
    main = {k: v for k, v in load_file(os.path.join(mtp_path, "model.safetensors")).items()}
    own = {"mtp.0." + k: v for k, v in mtp_own(config.hidden_size, config.hc_mult,
                                                MTP_SEED + 2).items()}
    loaded = []
    for weights in (iter_checkpoint(mtp_path), [*main.items(), *block.items(), *own.items()]):
        model = DeepseekV4ForCausalLM(config, CPUOps(PagedCache()), 1024, mtp=True)
        model.load_weights(weights)
        loaded.append(dict(model.named_parameters()))
    assert any(name.startswith("mtp.block.mlp.") for name in loaded[0])
    for name, param in loaded[0].items():
        assert torch.equal(param, loaded[1][name]), name


def test_kv_spec_puts_the_mtp_window_in_the_window_group(mtp_path):
    config = transformers.AutoConfig.from_pretrained(mtp_path)
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        spec = DeepseekV4ForCausalLM(config, None, 1024, mtp=True).kv_spec()
    assert [g.layers for g in spec.groups] == [(0, 1, 2, 5), (3,), (4,)]


def test_refusals_name_the_missing_piece(mtp_path, v4_checkpoint):
    with pytest.raises(ValueError, match="at most 3 speculative tokens"):
        _llm(mtp_path, 4)
    with pytest.raises(ValueError, match="no weights for its multi-token-prediction layer"):
        _llm(v4_checkpoint, 1)
