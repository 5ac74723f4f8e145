"""DeepSeek-V4 checkpoint names -> our parameters.

Our modules carry transformers' names (`layers.{i}.self_attn.q_a_proj.weight`,
`.self_attn.compressor.indexer.scorer.weights_proj.weight`, ...), so a transformers state dict
maps 1:1 once "model." is dropped. Two other spellings reach us, and are renamed as
transformers' conversion mapping ("deepseek_v4" in conversion_mapping.py) renames them:

- DeepSeek's release (`embed.weight`, `head.weight`, `layers.{i}.attn.wq_a.weight`,
  `.attn.indexer.compressor.ape`, `.attn_norm.weight`, ...);
- what transformers' own save_pretrained writes: the release names under "model." (except
  `head.weight`), with transformers' embed_tokens.

Hyper-connection names are hyper.py's (`hyper_target`), MoE names moe_names.py's
(`moe_tensors` runs over the stream first, `moe_target` places them). The multi-token-
prediction layers (`mtp.*`) are skipped until MTP is served.
"""
from __future__ import annotations

import re

from torch import nn

from deepinfer.models.deepseek_v4.hyper import hyper_target
from deepinfer.models.deepseek_v4.moe_names import moe_target
from deepinfer.models.weight_targets import Target

_TOP = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight"}
# In order: the indexer's names move under the compressor before `.attn.` is renamed.
_RENAMES = tuple((re.compile(pattern), new) for pattern, new in (
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    # attention's, compressors' and the indexer's kv norms (the model's `norm` has no layer)
    (r"^(layers\.\d+\.self_attn\.(?:\w+\.)*)norm\.weight$", r"\1kv_norm.weight"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
))


def v4_name(name: str) -> str | None:
    """Any spelling of a non-MoE, non-mHC tensor's name -> our parameter's; None to skip."""
    name = name.removeprefix("model.")
    if name.startswith("mtp.") or "rotary_emb" in name:
        return None
    name = _TOP.get(name, name)
    for pattern, new in _RENAMES:
        name = pattern.sub(new, name)
    return name


def checkpoint_target(layers: nn.ModuleList, name: str) -> Target | list[Target] | None:
    """A checkpoint tensor (after moe_tensors) -> its place(s) in the model; None to skip."""
    renamed = v4_name(name)
    if renamed is None:
        return None
    hyper = hyper_target(renamed)
    if hyper is not None:
        return hyper, None
    moe = moe_target(layers, renamed)
    if moe is not None:
        return moe
    return renamed, None
