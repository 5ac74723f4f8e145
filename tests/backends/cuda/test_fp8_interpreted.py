"""FP8 weights on the CUDA backend, its kernels under Triton's interpreter: a checkpoint in
DeepSeek's block-scaled layout stays FP8 in memory and runs fp8_linear (the weight-only GEMV
for decode rows, the w8a8 GEMM for a prefill), and `--quantization fp8` quantizes a float
checkpoint at load. Both against transformers on the same weights dequantized."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.quant.packed import FP8Weight
from deepinfer.models.quant.tensors import RowScaledFP8
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.checkpoints import make_checkpoint, write_fp8_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")

# Two 128-wide scale groups per row; q | k | v rows 256 | 128 | 128.
DIMS = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=1)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 88, 120, 64, 33, 2]


def _engine(path: str, quantization: str = "auto") -> Engine:
    config = EngineConfig(model=ModelSpec(path, dtype="float32", quantization=quantization),
                          cache=CacheConfig(block_size=16, num_blocks=8))
    return Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)


def _prefill_logits(engine: Engine) -> torch.Tensor:
    n = len(PROMPT)
    batch = ModelBatch(PROMPT, list(range(n)), [n], [n], (GroupBatch([[1]], [16 + p for p in
                                                                     range(n)]),), 16, [0], [])
    return engine.accelerator.forward_logits(batch, all_tokens=True)


def _greedy(engine: Engine, new: int) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=new,
                                                   ignore_eos=True))
    got = []
    while engine.has_unfinished_requests():
        got += [list(out.token_ids) for out in engine.step() if out.finished]
    return got[0]


def _reference_logits(reference: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


def _fp8_modules(engine: Engine) -> list[FP8Weight]:
    model = engine.accelerator.runner.model
    return [m for m in model.modules() if isinstance(m, FP8Weight)]


def _assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Within what the prefill GEMM's FP8 activations cost: e4m3's 3 mantissa bits give each
    projection's input ~2.6% rms error, ~8% on these logits after four of them (measured);
    a wrong scale or row is off by far more."""
    assert (ours - expected).norm() < 0.15 * expected.norm()
    # Where a row's top-2 margin is over twice its largest error, the argmax cannot move.
    margin = expected.topk(2, dim=-1).values.diff(dim=-1).abs()[:, 0]
    clear = margin > 2 * (ours - expected).abs().amax(dim=-1)
    assert clear.any()
    assert (ours.argmax(-1) == expected.argmax(-1))[clear].all()


def test_fp8_checkpoint_stays_fp8(tmp_path):
    """Prefill (the w8a8 GEMM) and greedy decode steps (the weight-only GEMV)."""
    source = make_checkpoint(str(tmp_path / "float"), "llama", **DIMS)
    fp8, dequantized = write_fp8_checkpoint(source, str(tmp_path / "fp8"), str(tmp_path / "deq"))
    engine = _engine(fp8)
    weights = _fp8_modules(engine)
    assert len(weights) == 4 * DIMS["num_hidden_layers"]  # qkv, o, gate_up, down
    assert all(w.weight.dtype == torch.float8_e4m3fn for w in weights)
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized,
                                                                  dtype=torch.float32).eval()
    engine.accelerator.allocate_kv_cache(8, 16)
    _assert_close(_prefill_logits(engine), _reference_logits(reference, PROMPT))
    ours = _greedy(engine, 4)
    engine.shutdown()
    steps = _reference_logits(reference, PROMPT + ours)[len(PROMPT) - 1:-1]
    clear = steps.topk(2, dim=-1).values.diff(dim=-1).abs()[:, 0] > 0.1 * steps.abs().max()
    assert (steps.argmax(-1) == torch.tensor(ours))[clear].all()


def test_quantize_at_load(tmp_path):
    source = make_checkpoint(str(tmp_path / "float"), "llama", **DIMS)
    engine = _engine(source, quantization="fp8")
    assert len(_fp8_modules(engine)) == 4 * DIMS["num_hidden_layers"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(source,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():  # the reference holds the weights as FP8 rounded them
        for name, module in reference.named_modules():
            if name.endswith("_proj") and ".layers." in f".{name}":
                blocks = RowScaledFP8.quantize(module.weight, block_rows=128)
                module.weight.copy_(blocks.dequantize())
    engine.accelerator.allocate_kv_cache(8, 16)
    _assert_close(_prefill_logits(engine), _reference_logits(reference, PROMPT))
    engine.shutdown()
