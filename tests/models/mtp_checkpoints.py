"""DeepSeek-V3 checkpoints with a multi-token-prediction layer, for speculative decoding.

transformers neither builds nor saves MTP layers, so they are added to a checkpoint it wrote:
the block is layer L of the same model grown to L + 1 layers (built and saved by transformers
with its own initialisation), beside random enorm/hnorm/eh_proj/shared_head.norm and the main
model's embedding and LM head as shared_head.head / embed_tokens (as DeepSeek's releases
hold copies of them).
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _write_config(path: str, config: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def mtp_block(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Layer L of the model grown to L + 1 layers, as save_pretrained names its tensors."""
    layers = config["num_hidden_layers"]
    grown = transformers.DeepseekV3Config(**{**config, "num_hidden_layers": layers + 1})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(grown).eval()
    for layer in model.model.layers[grown.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)  # zeros in transformers
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    prefix = f"model.layers.{layers}."
    return {name: t for name, t in saved.items() if name.startswith(prefix)}


def add_mtp(path: str, seed: int) -> str:
    """Give the checkpoint at `path` a random MTP layer (a dense one when every decoder layer
    is dense: first_k_dense_replace is moved past it)."""
    config = _read_config(path)
    layers = config["num_hidden_layers"]
    if config.get("first_k_dense_replace", 0) >= layers:
        config["first_k_dense_replace"] = layers + 1
    config["num_nextn_predict_layers"] = 1
    main = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    tensors = {**mtp_block(config, seed),
               **_mtp_head(layers, main, 1.0 + 0.1 * torch.randn(3, h, generator=g),
                           0.1 * torch.randn(h, 2 * h, generator=g))}
    save_file(tensors, os.path.join(path, "mtp.safetensors"))
    _write_config(path, config)
    return path


def _mtp_head(layers: int, main: dict[str, torch.Tensor], norms: torch.Tensor,
              eh_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layers}."
    return {p + "enorm.weight": norms[0].contiguous(), p + "hnorm.weight": norms[1].contiguous(),
            p + "shared_head.norm.weight": norms[2].contiguous(),
            p + "eh_proj.weight": eh_proj.contiguous(),
            p + "shared_head.head.weight": main["lm_head.weight"].clone(),
            p + "embed_tokens.weight": main["model.embed_tokens.weight"].clone()}


def make_successor_model(path: str, dims: dict, seed: int = 0) -> tuple[str, list[int]]:
    """A DeepSeek-V3 checkpoint whose greedy next token is succ[last token], and an MTP layer
    that drafts exactly that: every draft is right.

    Attention and MLP outputs are zeroed (o_proj, down_proj), so the final hidden state is the
    normed embedding of the last token; the LM head's row succ[t] is the embedding of t, so
    succ[t] wins. The MTP block is zeroed likewise and eh_proj keeps only the embedding half,
    so the draft layer scores the next token's embedding with the same head."""
    config = transformers.DeepseekV3Config(**dims, first_k_dense_replace=dims["num_hidden_layers"])
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    vocab, h = dims["vocab_size"], dims["hidden_size"]
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        model.lm_head.weight[succ] = embed.clone()
    model.save_pretrained(path)
    _zeroed_mtp(path, h)
    return path, succ.tolist()


def _zeroed_mtp(path: str, h: int) -> None:
    config = _read_config(path)
    layers = config["num_hidden_layers"]
    config["first_k_dense_replace"] = layers + 1
    config["num_nextn_predict_layers"] = 1
    block = mtp_block(config, seed=1)
    for name, tensor in block.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    main = load_file(os.path.join(path, "model.safetensors"))
    eh_proj = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    tensors = {**block, **_mtp_head(layers, main, torch.ones(3, h), eh_proj)}
    save_file(tensors, os.path.join(path, "mtp.safetensors"))
    _write_config(path, config)


def add_word_tokenizer(path: str, vocab: int) -> str:
    """A tokenizer for the checkpoint: token i is the word "<i>", words joined by spaces, so a
    stop string can name exactly one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"<{i}>": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path
