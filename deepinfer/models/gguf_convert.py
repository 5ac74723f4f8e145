"""Convert a llama-family GGUF (llama, mistral, qwen2, qwen3) into an HF-style checkpoint folder.

The engine loads HF folders only; a GGUF is dequantized once here and cached, so later starts
neither need the GGUF code path nor pay for dequantization again.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from types import MappingProxyType
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from deepinfer.models.gguf_folder import (
    FORMAT_VERSION,
    GGUF_FILE,
    GGUF_INDEX_FILE,
    MARKER_FILE,
    converted_dir,
    is_converted,
)
from deepinfer.models.quant.tensors import GGUFTensor

# GGUF architecture -> (HF model_type, HF architecture class).
_ARCHITECTURES = MappingProxyType({
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
})
_GLOBAL_TENSORS = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
# Per-layer names, blk.N.<key> -> model.layers.N.<value>.
_LAYER_TENSORS = MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
       for p in "qkv" for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
# float32 keeps dequantized values exact; above this size it would cost too much disk and memory.
_FLOAT32_MAX_PARAMS = 2_000_000_000
_SAFETENSORS_DTYPES = MappingProxyType({torch.float32: "F32", torch.bfloat16: "BF16"})


def keep_source(gguf_path: str, out_dir: str, plan: list[_PlannedTensor] | None = None) -> None:
    """Copy the GGUF into a converted folder with the index of its tensors (written last,
    after a rename, so a reader never sees half of either)."""
    if plan is None:
        with open(os.path.join(out_dir, "config.json")) as f:
            plan = tensor_plan(GGUFReader(gguf_path), json.load(f))
    partial = os.path.join(out_dir, f".{GGUF_FILE}.{os.getpid()}")
    shutil.copyfile(gguf_path, partial)
    os.replace(partial, os.path.join(out_dir, GGUF_FILE))
    index = os.path.join(out_dir, GGUF_INDEX_FILE)
    _write_json(f"{index}.{os.getpid()}", {"tensors": [t.index_entry() for t in plan]})
    os.replace(f"{index}.{os.getpid()}", index)


def convert_gguf(gguf_path: str, out_dir: str | None = None, progress: bool = True) -> str:
    """Convert `gguf_path` into an HF folder (config, safetensors, tokenizer) and return its path.

    Returns at once when `out_dir` already holds a complete conversion. The folder is built in a
    temp sibling and renamed into place, so a crash never leaves a half-written checkpoint.
    """
    out_dir = out_dir or converted_dir(gguf_path)
    if is_converted(out_dir):
        return out_dir
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists but is not a complete conversion; remove it first")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0700 would carry over to the final folder
        _convert_into(gguf_path, tmp_dir, progress)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not is_converted(out_dir):  # not a concurrent converter that finished first
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _convert_into(gguf_path: str, out_dir: str, progress: bool) -> None:
    reader = GGUFReader(gguf_path)
    meta = _Metadata(reader)
    config = _hf_config(reader, meta)
    plan = tensor_plan(reader, config)
    dtype = _choose_dtype(reader)
    # transformers 5 reads "dtype", older readers "torch_dtype".
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    _write_safetensors(os.path.join(out_dir, "model.safetensors"), plan, dtype, config, progress)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(meta))
    _save_tokenizer(gguf_path, meta, out_dir)
    keep_source(gguf_path, out_dir, plan)
    _write_json(os.path.join(out_dir, MARKER_FILE), {
        "format_version": FORMAT_VERSION,
        "source": os.path.basename(gguf_path),
        "source_bytes": os.path.getsize(gguf_path),
    })


class _Metadata:
    """Typed access to GGUF key/values; `arch(...)` reads the `<architecture>.` prefixed ones."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self.architecture: str = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)


def _hf_config(reader: GGUFReader, meta: _Metadata) -> dict[str, Any]:
    if meta.architecture not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {meta.architecture!r}; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    model_type, hf_class = _ARCHITECTURES[meta.architecture]
    tensors = {t.name: t for t in reader.tensors}
    heads = int(meta.arch("attention.head_count"))
    kv_heads = meta.arch("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError("per-layer head_count_kv is not a llama-family layout")
    hidden = int(meta.arch("embedding_length"))
    head_dim = int(meta.arch("attention.key_length", hidden // heads))
    rope_theta = float(meta.arch("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.arch("context_length", 4096)),
        # The embedding's row count, not the token list: some files pad the vocabulary.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if model_type != "llama":
        config["use_sliding_window"] = False
    rope_scaling = _rope_scaling(meta, tensors.get("rope_freqs.weight"), head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: _Metadata, rope_freqs: ReaderTensor | None, head_dim: int,
                  rope_theta: float) -> dict[str, Any] | None:
    kind = meta.arch("rope.scaling.type")
    factor = meta.arch("rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        original = meta.arch("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if rope_freqs is None:
        return None
    # llama.cpp bakes Llama 3's rope scaling into a rope_freqs tensor and drops the parameters.
    # Every Llama 3.x release used low=1, high=4, original=8192 with a varying factor; recover
    # the factor and check that those parameters reproduce the tensor exactly.
    stored = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type),
                        dtype=np.float64).ravel()
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(_llama3_rope_factors(scaling, head_dim, rope_theta), stored, rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; unsupported")
    return scaling


def _llama3_rope_factors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for Llama 3."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


class _PlannedTensor:
    """One output tensor: where it comes from, its HF shape, and how many heads to unpermute."""

    def __init__(self, name: str, source: ReaderTensor, unpermute_heads: int | None) -> None:
        self.name = name
        self.source = source
        self.shape = [int(d) for d in reversed(source.shape)]  # GGUF lists dims fastest-first
        self.unpermute_heads = unpermute_heads

    def index_entry(self) -> dict[str, Any]:
        """Where the tensor lies in the file, for StoredTensor."""
        source = self.source
        return {"name": self.name, "type": int(source.tensor_type),
                "offset": int(source.data_offset), "bytes": int(source.n_bytes),
                "gguf_shape": [int(d) for d in source.shape],
                "unpermute_heads": self.unpermute_heads}

    def packed(self, keep: frozenset[int]) -> torch.Tensor | GGUFTensor:
        """The tensor with its blocks as stored where its type is in `keep` (GGUF types a
        backend runs natively), else dequantized as load() does."""
        if self.source.tensor_type not in keep or len(self.shape) != 2:
            return self.load()
        blocks = np.asarray(self.source.data).reshape(self.shape[0], -1)
        if self.unpermute_heads is not None:  # rows move whole: blocks never straddle rows
            blocks = _unpermute(blocks, self.unpermute_heads)
        tensor = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C"))
        return GGUFTensor(tensor, int(self.source.tensor_type), (self.shape[0], self.shape[1]))

    def load(self) -> torch.Tensor:
        array = dequantize(self.source.data, self.source.tensor_type).reshape(self.shape)
        if self.unpermute_heads is not None:
            array = _unpermute(array, self.unpermute_heads)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))


class StoredTensor:
    """A tensor of a GGUF file read through GGUF_INDEX_FILE: the ReaderTensor attributes that
    _PlannedTensor reads."""

    def __init__(self, mapped: np.ndarray, entry: dict[str, Any]) -> None:
        self.tensor_type = GGMLQuantizationType(entry["type"])
        self.shape = entry["gguf_shape"]
        raw = mapped[entry["offset"]:entry["offset"] + entry["bytes"]]
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        if self.tensor_type in floats:
            self.data = raw.view(floats[self.tensor_type]).reshape(list(reversed(self.shape)))
        else:
            self.data = raw.reshape(rows, -1)


def indexed_plan(folder: str) -> list[_PlannedTensor]:
    """The folder's planned tensors read from its kept GGUF through its index."""
    with open(os.path.join(folder, GGUF_INDEX_FILE)) as f:
        entries = json.load(f)["tensors"]
    mapped = np.memmap(os.path.join(folder, GGUF_FILE), dtype=np.uint8, mode="r")
    return [_PlannedTensor(e["name"], StoredTensor(mapped, e), e["unpermute_heads"])
            for e in entries]


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Its converter stores w.reshape(n_heads, 2, d, ...).swapaxes(1, 2) so that ggml's rope can
    rotate adjacent pairs; HF rotates the two halves of each head, so swap the axes back.
    """
    d = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_plan(reader: GGUFReader, config: dict[str, Any]) -> list[_PlannedTensor]:
    # Only llama.cpp's llama converter (also used for Mistral) permutes q/k; qwen's do not.
    permuted = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    plan = []
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        if tensor.name in _GLOBAL_TENSORS:
            plan.append(_PlannedTensor(_GLOBAL_TENSORS[tensor.name], tensor, None))
            continue
        block, layer, key = (tensor.name.split(".", 2) + ["", ""])[:3]
        if block != "blk" or key not in _LAYER_TENSORS:
            raise ValueError(f"unexpected tensor {tensor.name!r} in a {config['model_type']} GGUF")
        n_heads = heads.get(key.split(".")[0]) if permuted else None
        plan.append(_PlannedTensor(f"model.layers.{layer}.{_LAYER_TENSORS[key]}", tensor, n_heads))
    return plan


def _choose_dtype(reader: GGUFReader) -> torch.dtype:
    if any(t.tensor_type == GGMLQuantizationType.BF16 for t in reader.tensors):
        return torch.bfloat16
    params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return torch.float32 if params <= _FLOAT32_MAX_PARAMS else torch.bfloat16


def _write_safetensors(path: str, plan: list[_PlannedTensor], dtype: torch.dtype,
                       config: dict[str, Any], progress: bool) -> None:
    """Stream tensors into a safetensors file one at a time.

    The header only needs shapes, which GGUF gives up front, so peak memory is one tensor rather
    than the whole model (safetensors.save_file would need all of them at once).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        size = int(np.prod(item.shape)) * itemsize
        header[item.name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": item.shape,
                             "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data 8-byte aligned
    bar = tqdm(plan, desc=f"Converting {config['architectures'][0]}", unit="tensor",
               disable=not progress)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for item in bar:
            _write_tensor(f, item.load().to(dtype))
        if f.tell() != 8 + len(encoded) + offset:  # a shape/dtype mismatch would corrupt the file
            raise RuntimeError(f"wrote {f.tell()} bytes to {path}, header promised more or less")


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def _generation_config(meta: _Metadata) -> dict[str, Any]:
    # End-of-turn tokens (Llama 3's <|eot_id|>, <|eom_id|>) must stop generation as well as EOS.
    eos = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    config: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                              "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def _save_tokenizer(gguf_path: str, meta: _Metadata, out_dir: str) -> None:
    """Rebuild the tokenizer from GGUF metadata with transformers' own converter."""
    from transformers import AutoTokenizer  # slow import, needed only while converting

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path),
        local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    # Artefacts of loading from a local file, not properties of the tokenizer.
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    # transformers 5 moves the template to chat_template.jinja; keep a copy here for readers
    # that only look at tokenizer_config.json.
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    # The class name every transformers version (and other tools) understands.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, tok_config)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
