"""MLA prefill on one GPU: the weight-absorbed kernel against the expanded one, over the same
paged latents, as CUDAOps runs each.

    python benchmarks/cuda/bench_mla_prefill.py --out DIR [--sweep]

absorbed: the query through W_UK, mla_attention.paged_mla_prefill over the latents, the output
through W_UV. expanded: mla_prefill.mla_expanded_prefill (the context's latents gathered,
decompressed by two GEMMs, flash attention over per-head keys and values). Both are timed
whole, and their rates are counted in the expanded form's FLOPs (2 x H x (N + R + V) a
visible (query, key) pair: the attention's own work), beside the lease's bf16 GEMM rate. Each
case checks the two outputs against each other first (relative error, bf16).

Cases: DeepSeek-V3's MLA (128 heads) and V2-Lite's (16 heads), fresh prompts of 512-8192
tokens, a 2,048-token chunk over 6,144 cached ones and a 4,096-token one over 28,672 (the
expanded form in 8,192-row pieces, as the nvidia backend runs it). --sweep times the
expanded kernel's tiles at each case. Writes mla_prefill.json and mla_prefill.png.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import pyplot, side_by_side, write_json  # noqa: E402

from deepinfer.backends.cuda.kernels.mla_attention import paged_mla_prefill  # noqa: E402
from deepinfer.backends.cuda.kernels.mla_prefill import mla_expanded_prefill  # noqa: E402
from deepinfer.backends.cuda.kernels.prefill_attention import PrefillConfig  # noqa: E402
from deepinfer.backends.cuda.timing import cuda_times_ms  # noqa: E402

LORA, ROPE, NOPE, VALUE, BLOCK_SIZE = 512, 64, 128, 128, 128
DEVICE = "cuda"
PIECE_TOKENS = 8192  # the nvidia backend's step budget: longer contexts go piece by piece
HEADS = {"deepseek_v3": 128, "v2_lite": 16}
# (name, [(cached prefix, new tokens)])
CASES = [("1x512", [(0, 512)]), ("16x512", [(0, 512)] * 16), ("1x2048", [(0, 2048)]),
         ("1x8192", [(0, 8192)]), ("2048 over 6144", [(6144, 2048)]),
         ("4096 over 28672", [(28672, 4096)])]
SWEEP = [PrefillConfig(m, n, w, st) for m, n, w, st in itertools.product(
    (64, 128), (32, 64, 128), (4, 8), (2, 3)) if not (m == 128 and n == 128 and w == 4)]


class Case:
    """Random bf16 inputs of one case: paged latents, the query's parts, kv_b_proj's halves."""

    def __init__(self, heads: int, chunks: list[tuple[int, int]]) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        lens = [p + n for p, n in chunks]
        blocks = [-(-n // BLOCK_SIZE) for n in lens]
        self.cache = torch.randn(((1 + sum(blocks)) * BLOCK_SIZE, LORA + ROPE), device=DEVICE,
                                 generator=g, dtype=torch.bfloat16)
        self.tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32, device=DEVICE)
        first = 1
        for i, nb in enumerate(blocks):
            self.tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            first += nb
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        self.host_lens = lens
        starts = [0]
        for _, n in chunks:
            starts.append(starts[-1] + n)
        self.starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.max_query = max(n for _, n in chunks)
        q = torch.randn((starts[-1], heads, NOPE + ROPE), device=DEVICE, generator=g,
                        dtype=torch.bfloat16)
        self.q_nope, self.q_pe = q[..., :NOPE], q[..., NOPE:]
        self.w_uk = (torch.randn((heads, NOPE, LORA), device=DEVICE, generator=g)
                     / LORA ** 0.5).to(torch.bfloat16)
        self.w_uv = (torch.randn((heads, LORA, VALUE), device=DEVICE, generator=g)
                     / LORA ** 0.5).to(torch.bfloat16)
        self.pairs = sum(n * p + n * (n + 1) // 2 for p, n in chunks)
        self.flops = 2 * heads * (NOPE + ROPE + VALUE) * self.pairs

    def absorbed(self) -> torch.Tensor:
        query = torch.cat((torch.einsum("thn,hnl->thl", self.q_nope, self.w_uk), self.q_pe), -1)
        out = paged_mla_prefill(query, self.cache, self.tables, self.starts, self.seq_lens,
                                self.max_query, BLOCK_SIZE, 0.1, LORA)
        return torch.einsum("thl,hlv->thv", out, self.w_uv)

    def expanded(self, cfg: PrefillConfig | None = None) -> torch.Tensor:
        return mla_expanded_prefill(self.q_nope, self.q_pe, self.cache, self.w_uk, self.w_uv,
                                    self.tables, self.starts, self.seq_lens, self.host_lens,
                                    self.max_query, BLOCK_SIZE, 0.1, cfg=cfg,
                                    piece_tokens=PIECE_TOKENS)


def _ms(fn) -> float:
    return statistics.median(cuda_times_ms(fn, reps=10, warmup=2))


def _try_ms(fn) -> float | str:
    try:
        return _ms(fn)
    except Exception as exc:  # noqa: BLE001 - a compiler refusal is a result of the sweep
        return f"failed: {type(exc).__name__}"


def run_case(model: str, name: str, chunks: list[tuple[int, int]], sweep: bool) -> dict:
    case = Case(HEADS[model], chunks)
    ref, got = case.absorbed().float(), case.expanded().float()
    row = {"model": model, "case": name, "heads": HEADS[model], "pairs": case.pairs,
           "flops": case.flops, "rel_error": ((got - ref).norm() / ref.norm()).item(),
           "absorbed_ms": _ms(case.absorbed), "expanded_ms": _ms(case.expanded)}
    row["speedup"] = row["absorbed_ms"] / row["expanded_ms"]
    for form in ("absorbed", "expanded"):
        row[f"{form}_tflops"] = case.flops / row[f"{form}_ms"] / 1e9
    if sweep:
        row["sweep"] = {str(tuple(cfg)): _try_ms(lambda cfg=cfg: case.expanded(cfg))
                        for cfg in SWEEP}
        timed = {k: v for k, v in row["sweep"].items() if isinstance(v, float)}
        row["best_config"] = min(timed, key=timed.get)
        row["best_ms"] = timed[row["best_config"]]
    print(f"{model:12s} {name:16s} absorbed {row['absorbed_ms']:8.2f} ms "
          f"({row['absorbed_tflops']:5.0f} TFLOP/s)  expanded {row['expanded_ms']:8.2f} ms "
          f"({row['expanded_tflops']:5.0f})  x{row['speedup']:.1f}  err {row['rel_error']:.1e}"
          + (f"  best {row['best_config']} {row['best_ms']:.2f} ms" if sweep else ""),
          flush=True)
    return row


def gemm_rate() -> float:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (_ms(lambda: a @ a) / 1e3)


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(HEADS), figsize=(12, 4.5), squeeze=False)
    for ax, model in zip(axes[0], HEADS):
        rows = [r for r in result["rows"] if r["model"] == model]
        ax.axhline(result["bf16_gemm_flops"] / 1e12, color="tab:red", ls="--",
                   label="bf16 GEMM rate")
        side_by_side(ax, [r["case"] for r in rows],
                     {form: [r[f"{form}_tflops"] for r in rows]
                      for form in ("absorbed", "expanded")})
        ax.set(title=f"{model}: {HEADS[model]} heads", ylabel="TFLOP/s (expanded form's FLOPs)")
    fig.suptitle(f"MLA prefill, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/cuda")
    p.add_argument("--sweep", action="store_true", help="time the expanded kernel's tiles")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bf16_gemm_flops": gemm_rate(), "rows": []}
    for model in HEADS:
        for name, chunks in CASES:
            result["rows"].append(run_case(model, name, chunks, args.sweep))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "mla_prefill.json"), result)
    plot(result, os.path.join(args.out, "mla_prefill.png"))


if __name__ == "__main__":
    main()
