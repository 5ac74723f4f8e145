"""MLA decode on one GPU at serving batch sizes: the absorbed kernel (mla_attention.
paged_mla_decode) over paged latents, at DeepSeek-V3's 128 heads and V2-Lite's 16, against the
lease's copy rate and bf16 GEMM rate.

    python benchmarks/cuda/bench_mla_decode.py --out DIR [--sweep]

A decode step reads each sequence's latents (L + R = 576 values a token) once per program
that serves a group of its heads, and does 2 x H x (576 + 512) FLOPs a token: at 128 heads the
FLOPs and the bytes take about as long (the bound below is the larger of the two). --sweep
times tiles (heads a program, keys a tile, warps, stages; splits as the backend chooses them
for that head group). Writes mla_decode_tiles.json and mla_decode_tiles.png.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import pyplot, side_by_side, write_json  # noqa: E402

from deepinfer.backends.cuda.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
)
from deepinfer.backends.cuda.kernels.mla_attention import (  # noqa: E402
    _MAX_BLOCK_H,
    _decode_config,
    choose_mla_num_splits,
    launch_mla_decode,
)
from deepinfer.backends.cuda.timing import cuda_times_ms  # noqa: E402

LORA, ROPE, BLOCK_SIZE, SCALE = 512, 64, 64, 0.1
DEVICE = "cuda"
HEADS = {"deepseek_v3": 128, "v2_lite": 16}
CASES = [(32, 1024), (256, 512), (256, 2048), (64, 8192)]  # (batch, context)
SWEEP = [(h, DecodeConfig(n, w, st)) for h, n, w, st in itertools.product(
    (16, 32, 64), (32, 64), (4, 8), (1, 2))]


class Case:
    def __init__(self, heads: int, batch: int, context: int) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        per_seq = -(-context // BLOCK_SIZE)
        self.cache = torch.randn((batch * per_seq * BLOCK_SIZE, LORA + ROPE), device=DEVICE,
                                 generator=g, dtype=torch.bfloat16)
        self.tables = torch.randperm(batch * per_seq, device=DEVICE, generator=g).to(
            torch.int32).view(batch, per_seq)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.q = torch.randn((batch, heads, LORA + ROPE), device=DEVICE, generator=g,
                             dtype=torch.bfloat16)
        self.heads, self.batch, self.context = heads, batch, context
        self.bytes = batch * context * (LORA + ROPE) * 2
        self.flops = 2 * batch * heads * context * (LORA + ROPE + LORA)

    def run(self, cfg: DecodeConfig, max_block_h: int, splits: int) -> torch.Tensor:
        return launch_mla_decode(self.q, self.cache, self.tables, self.lens, BLOCK_SIZE, SCALE,
                                 splits, LORA, None, cfg, max_block_h=max_block_h)

    def default(self) -> torch.Tensor:
        splits = choose_mla_num_splits(self.batch, self.heads, self.context, _sms())
        return self.run(_decode_config(LORA), _MAX_BLOCK_H, splits)

    def splits_for(self, block_h: int) -> int:
        groups = triton.cdiv(self.heads, block_h)
        return choose_num_splits(self.batch, groups, self.context, _sms(), programs_per_sm=1,
                                 min_tokens_per_split=256)


def _sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _ms(fn) -> float:
    return statistics.median(cuda_times_ms(fn, reps=20, warmup=3))


def _try_ms(case: Case, ref: torch.Tensor, h: int, cfg: DecodeConfig) -> float | str:
    try:
        splits = case.splits_for(h)
        got = case.run(cfg, h, splits)
        if not torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2):
            return "wrong"
        return _ms(lambda: case.run(cfg, h, splits))
    except Exception as exc:  # noqa: BLE001 - a compiler refusal is a result of the sweep
        return f"failed: {type(exc).__name__}"


def rates() -> tuple[float, float]:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    gemm = 2 * 8192 ** 3 / (_ms(lambda: a @ a) / 1e3)
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (_ms(lambda: y.copy_(x)) / 1e3)
    return gemm, copy


def run_case(model: str, batch: int, context: int, sweep: bool, gemm: float, copy: float
             ) -> dict:
    case = Case(HEADS[model], batch, context)
    ref = case.default().float()
    bound_ms = max(case.bytes / copy, case.flops / gemm) * 1e3
    row = {"model": model, "heads": case.heads, "batch": batch, "context": context,
           "bytes": case.bytes, "flops": case.flops, "bound_ms": bound_ms,
           "default_ms": _ms(case.default)}
    row["default_share"] = bound_ms / row["default_ms"]
    if sweep:
        row["sweep"] = {f"h{h} {tuple(cfg)}": _try_ms(case, ref, h, cfg) for h, cfg in SWEEP}
        timed = {k: v for k, v in row["sweep"].items() if isinstance(v, float)}
        row["best_config"] = min(timed, key=timed.get)
        row["best_ms"] = timed[row["best_config"]]
        row["best_share"] = bound_ms / row["best_ms"]
    print(f"{model:12s} B={batch:4d} ctx={context:5d} default {row['default_ms']:.3f} ms "
          f"({row['default_share']:.0%} of bound {bound_ms:.3f})"
          + (f"  best {row['best_config']} {row['best_ms']:.3f} ms ({row['best_share']:.0%})"
             if sweep else ""), flush=True)
    return row


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(HEADS), figsize=(12, 4.5), squeeze=False)
    for ax, model in zip(axes[0], HEADS):
        rows = [r for r in result["rows"] if r["model"] == model]
        series = {"default": [r["default_share"] for r in rows]}
        if all("best_share" in r for r in rows):
            series["best of sweep"] = [r["best_share"] for r in rows]
        side_by_side(ax, [f"{r['batch']}x{r['context']}" for r in rows], series)
        ax.set(title=f"{model}: {HEADS[model]} heads", ylabel="share of bound")
    fig.suptitle(f"MLA decode, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/cuda")
    p.add_argument("--sweep", action="store_true", help="time the kernel's tiles")
    args = p.parse_args()
    gemm, copy = rates()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bf16_gemm_flops": gemm, "copy_bytes_per_s": copy, "rows": []}
    for model in HEADS:
        for batch, context in CASES:
            result["rows"].append(run_case(model, batch, context, args.sweep, gemm, copy))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "mla_decode_tiles.json"), result)
    plot(result, os.path.join(args.out, "mla_decode_tiles.png"))


if __name__ == "__main__":
    main()
