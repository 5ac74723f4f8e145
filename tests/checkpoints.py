"""Tiny random-weight checkpoints written by transformers itself (the independent reference)."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import torch


def checkpoint_cache(tmp_path_factory, make: Callable[[str, str], str]) -> Callable[[str], str]:
    """name -> path of `make(folder, name)`, written once (for a module-scoped fixture)."""
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = make(str(tmp_path_factory.mktemp(name)), name)
        return paths[name]
    return get


def make_checkpoint(path: str, family: str = "llama", dtype: torch.dtype = torch.float32,
                    **overrides) -> str:
    """Save a random-weight transformers model of the given family to `path`."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=255,
                  bos_token_id=1, tie_word_embeddings=False)
    common.update(overrides)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "deepseek_v3":  # MLA attention, every layer dense (MoE comes later)
        mla = dict(num_key_value_heads=common["num_attention_heads"], q_lora_rank=64,
                   kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                   first_k_dense_replace=common["num_hidden_layers"], n_routed_experts=4,
                   num_experts_per_tok=2)
        config = transformers.DeepseekV3Config(**{**common, **mla, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the rest MoE
        moe = dict(head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)
        config = transformers.Qwen3MoeConfig(**{**common, **moe, **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 32,
                                               "num_local_experts": 4, "num_experts_per_tok": 2,
                                               **overrides})
        cls = transformers.MixtralForCausalLM
    elif family == "deepseek_v3_moe":  # MLA, layer 0 dense, then MoE with shared experts
        moe = dict(num_key_value_heads=common["num_attention_heads"], q_lora_rank=32,
                   kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
        config = transformers.DeepseekV3Config(**{**common, **moe, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    if family == "deepseek_v3_moe":  # transformers initialises the bias to zeros: make it count
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def _block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout, written here independently of the loader: per block of
    block[0] x block[1], scale_inv = amax / 448 and codes = w / scale_inv in float8_e4m3fn."""
    n, k = w.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(w.float(), (0, -k % b1, 0, -n % b0))
    blocks = padded.view(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.view(padded.shape)[:n, :k].contiguous(), scale


def _block_dequantize(codes: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    n, k = codes.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return codes.float() * full


def write_fp8_checkpoint(source: str, fp8_dir: str, dequantized_dir: str,
                         block: tuple[int, int] = (128, 128)) -> tuple[str, str]:
    """A float checkpoint rewritten as DeepSeek ships its releases: every projection weight of
    the decoder layers in float8_e4m3fn with a `weight_scale_inv` per block, and
    `quantization_config` in config.json; beside it the same weights dequantized in float32
    (what transformers loads as the reference)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(source, "model.safetensors"))
    fp8, plain = {}, {}
    for name, tensor in weights.items():
        if name.endswith("_proj.weight") and ".layers." in name and tensor.dim() == 2:
            codes, scale = _block_quantize(tensor, block)
            fp8[name], fp8[name + "_scale_inv"] = codes, scale
            plain[name] = _block_dequantize(codes, scale, block)
        else:
            fp8[name] = plain[name] = tensor
    for out, tensors in ((fp8_dir, fp8), (dequantized_dir, plain)):
        shutil.copytree(source, out, dirs_exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return fp8_dir, dequantized_dir


def copy_default_tokenizer(path: str) -> str:
    """The embedded default model's tokenizer files (SmolLM2's vocabulary, chat template and
    end token) copied into `path`: a server needs a tokenizer beside the weights."""
    from deepinfer.models.default_model import ensure_default_model

    os.makedirs(path, exist_ok=True)
    source = ensure_default_model(progress=False)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(source, name), path)
    return path


def make_moe_chat_checkpoint(path: str) -> str:
    """make_checkpoint's random qwen3_moe with the default model's tokenizer (its vocabulary
    and end token): the expert-parallel servers' checkpoint."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(copy_default_tokenizer(path))
    return make_checkpoint(path, "qwen3_moe", vocab_size=len(tokenizer),
                           eos_token_id=tokenizer.eos_token_id)


# A Hermes-style chat template in the Qwen2.5 convention (ChatML turns, which the default
# model's tokenizer has as special tokens): the tools' JSON in the system turn, an assistant's
# tool_calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and consecutive tool
# results as <tool_response> blocks in one user turn. The server's own rendering of tool calls
# (for templates without them) is not involved when a checkpoint ships this.
HERMES_TOOL_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\
\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
