"""DeepSeek-V4 checkpoints with a multi-token-prediction layer, for speculative decoding.

transformers neither builds nor saves V4's MTP layer (`mtp.*` is ignored on load), so it is
added to a checkpoint transformers wrote: the block is layer L of the same model grown to L + 1
layers (a sliding-window layer with learned MoE, as DeepSeek's release has it), built and saved
by transformers and renamed from `model.layers.{L}.` to `mtp.0.`; beside it random e_proj,
h_proj, enorm, hnorm, norm and hc_head_{fn,base,scale} under the release's names.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file


def grown(config: dict) -> dict:
    """The config with the MTP layer as layer L."""
    return {**config, "num_hidden_layers": config["num_hidden_layers"] + 1,
            "layer_types": [*config["layer_types"], "sliding_attention"],
            "mlp_layer_types": [*config["mlp_layer_types"], "moe"]}


def grown_model(config: dict, seed: int) -> transformers.DeepseekV4ForCausalLM:
    """transformers' model grown by the MTP layer, zero-initialised parameters made to count."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**grown(config)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "e_score_correction_bias", ".base")):
                param.normal_(0.0, 0.5, generator=g)
    return model.eval()


def mtp_own(hidden: int, hc_mult: int, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer's own tensors (release names, without the `mtp.0.` prefix)."""
    g = torch.Generator().manual_seed(seed)
    return {"e_proj.weight": 0.2 * torch.randn(hidden, hidden, generator=g),
            "h_proj.weight": 0.2 * torch.randn(hidden, hidden, generator=g),
            "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
            "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
            "norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=g),
            "hc_head_fn": 0.05 * torch.randn(hc_mult, hc_mult * hidden, generator=g),
            "hc_head_base": 0.5 * torch.randn(hc_mult, generator=g),
            "hc_head_scale": 0.5 + torch.rand(1, generator=g)}


def add_v4_mtp(path: str, seed: int) -> str:
    """Give the V4 checkpoint at `path` an MTP layer (`mtp.safetensors`)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        grown_model(config, seed).save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    prefix = f"model.layers.{layers}."
    tensors = {"mtp.0." + name[len(prefix):]: t.contiguous() for name, t in saved.items()
               if name.startswith(prefix)}
    own = mtp_own(config["hidden_size"], config["hc_mult"], seed + 2)
    tensors.update({"mtp.0." + name: t for name, t in own.items()})
    save_file(tensors, os.path.join(path, "mtp.safetensors"))
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
