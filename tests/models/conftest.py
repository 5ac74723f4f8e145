"""Fixtures several model test modules share."""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.checkpoints import checkpoint_cache


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory) -> str:
    """The tiny random DeepSeek-V4 checkpoint (real vocabulary) of test_deepseek_v4_parity."""
    from tests.models.test_deepseek_v4_parity import make_v4

    return checkpoint_cache(tmp_path_factory, make_v4)("v4")


@pytest.fixture(scope="module")
def v4_reference(v4_checkpoint) -> transformers.PreTrainedModel:
    """transformers' DeepseekV4ForCausalLM on it, float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(v4_checkpoint,
                                                             dtype=torch.float32).eval()
