"""FP8 weights on the CUDA backend, its kernels under Triton's interpreter: a checkpoint in
DeepSeek's block-scaled layout stays FP8 in memory and runs fp8_linear (the weight-only GEMV
for decode rows, the w8a8 GEMM for a prefill), an MoE's experts stay FP8 in the fused MoE
kernels, and `--quantization fp8` quantizes a float checkpoint at load (experts too). All
against transformers on the same weights dequantized."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.quant.packed import FP8Experts, FP8Weight
from deepinfer.models.quant.tensors import RowScaledFP8
from tests.backends.cuda.test_backend_interpreted import _interpreted_cls
from tests.checkpoints import make_checkpoint, write_fp8_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels under Triton's CPU interpreter")

# Two 128-wide scale groups per row; q | k | v rows 256 | 128 | 128.
DIMS = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=1)
# Qwen3-MoE: layer 0 dense, layer 1 eight experts of width 128, two per token.
MOE_DIMS = dict(DIMS, moe_intermediate_size=128, num_hidden_layers=2)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 88, 120, 64, 33, 2]


def _engine(path: str, quantization: str = "auto") -> Engine:
    config = EngineConfig(model=ModelSpec(path, dtype="float32", quantization=quantization),
                          cache=CacheConfig(block_size=16, num_blocks=8))
    return Engine(config, accelerator=_interpreted_cls()(), load_tokenizer=False)


def _prefill_logits(engine: Engine) -> torch.Tensor:
    n = len(PROMPT)
    batch = ModelBatch(PROMPT, list(range(n)), [n], [n], (GroupBatch([[1]], [16 + p for p in
                                                                     range(n)]),), [0], [])
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


def _fp8_modules(engine: Engine, kind: type = FP8Weight) -> list:
    model = engine.accelerator.runner.model
    return [m for m in model.modules() if isinstance(m, kind)]


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


def _greedy_top(engine: Engine, new: int) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Greedy tokens and each step's top-5 (token, logprob)."""
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=new,
                                                   ignore_eos=True, logprobs=5))
    tokens, tops = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            tops += [step.top for step in out.new_logprobs]
    return tokens, tops


def _check_against(engine: Engine, dequantized: str) -> None:
    """Prefill logits (12 tokens x 2 routes over 8 experts: the w8a8 grouped GEMMs), then
    four greedy steps (one token: the weight-only expert GEMVs) whose top-5 logprobs must be
    transformers' on the same tokens within the prefill check's tolerance: the steps read the
    prompt's K and V, which carry FP8's rounding of its activations (~8% of the logits'
    spread). The kernels' own precision is tested in test_fused_moe_fp8.py; a wrong slot,
    row or scale as the experts load is off by far more."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized,
                                                                  dtype=torch.float32).eval()
    engine.accelerator.allocate_kv_cache(8, 16)
    _assert_close(_prefill_logits(engine), _reference_logits(reference, PROMPT))
    ours, tops = _greedy_top(engine, 4)
    engine.shutdown()
    expected = _reference_logits(reference, PROMPT + ours)[len(PROMPT) - 1:-1].log_softmax(-1)
    assert len(tops) == len(expected) == 4
    for step, top in zip(expected, tops):
        ids, logprobs = zip(*top)
        assert (torch.tensor(logprobs) - step[list(ids)]).abs().max() < 0.2 * step.std()


def test_fp8_moe_checkpoint_keeps_experts_fp8(tmp_path):
    source = make_checkpoint(str(tmp_path / "float"), "qwen3_moe", **MOE_DIMS)
    fp8, dequantized = write_fp8_checkpoint(source, str(tmp_path / "fp8"), str(tmp_path / "deq"))
    engine = _engine(fp8)
    experts = _fp8_modules(engine, FP8Experts)
    assert [tuple(e.shape) for e in experts] == [(8, 256, 256), (8, 256, 128)]  # w13, w2
    assert all(e.weight.dtype == torch.float8_e4m3fn for e in experts)
    _check_against(engine, dequantized)


def test_quantize_at_load_takes_the_experts(tmp_path):
    """A float MoE checkpoint with quantization="fp8": experts in DeepSeek's 128 x 128 blocks,
    as write_fp8_checkpoint rounds the reference's weights."""
    source = make_checkpoint(str(tmp_path / "float"), "qwen3_moe", **MOE_DIMS)
    _, dequantized = write_fp8_checkpoint(source, str(tmp_path / "fp8"), str(tmp_path / "deq"))
    engine = _engine(source, quantization="fp8")
    assert len(_fp8_modules(engine, FP8Experts)) == 2
    _check_against(engine, dequantized)
