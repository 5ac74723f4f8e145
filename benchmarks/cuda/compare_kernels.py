"""The row-wise kernels of two source trees side by side on one GPU: RMSNorm (plain, fused
residual add, per-head, V4's), V4's interleaved rope, the split-K merge and the MoE route
sums, each at one, a few and many rows. Both trees' launchers get the same inputs; the script
reports whether the outputs are bit-identical, each tree's time per call (CUDA-graph replays,
the before tree timed twice to show the spread) and the HBM bound of the bytes each call moves
at the copy rate measured in the same run.

    python benchmarks/cuda/compare_kernels.py BEFORE_TREE [--out DIR]   (on the GPU)
    python benchmarks/cuda/compare_kernels.py --plot DIR                 (anywhere)

BEFORE_TREE is an export of the other commit (git archive COMMIT | tar -x -C DIR); its kernel
modules are loaded beside this tree's. Writes DIR/kernel_compare.json and .png.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Callable

KERNELS = "deepinfer/backends/cuda/kernels"
MODULES = ("norm", "interleaved_rope", "decode_attention", "fused_moe")


def load_tree(tree: Path, tag: str) -> dict:
    """The kernel modules of `tree`, imported under names of their own."""
    out = {}
    for name in MODULES:
        path = tree / KERNELS / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{tag}_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while decorating
        spec.loader.exec_module(module)
        out[name] = module
    return out


def copy_rate() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    import torch
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=200)
    return 2 * src.numel() / (ms * 1e-3)


def cases():
    """(name, bytes moved, make(modules) -> call) for each shape."""
    import torch

    dev, bf = "cuda", torch.bfloat16
    for t in (1, 32, 4096):
        x, r = (torch.randn(t, 4096, device=dev, dtype=bf) for _ in range(2))
        w = torch.randn(4096, device=dev, dtype=bf)
        yield f"rms_norm [{t},4096]", 2 * x.nbytes, lambda m, x=x, w=w: (
            lambda: m["norm"].rms_norm(x, w, 1e-6))
        yield f"add_rms_norm [{t},4096]", 4 * x.nbytes, lambda m, x=x, r=r, w=w: (
            lambda: m["norm"].add_rms_norm(x, r.clone(), w, 1e-6)[0])
        q = torch.randn(t, 32, 128, device=dev, dtype=bf)
        wq = torch.randn(128, device=dev, dtype=bf)
        yield f"rms_norm heads [{t},32,128]", 2 * q.nbytes, lambda m, q=q, wq=wq: (
            lambda: m["norm"].rms_norm(q, wq, 1e-6))
        x7 = torch.randn(t, 7168, device=dev, dtype=bf)
        w7 = torch.randn(7168, device=dev)
        yield f"v4_rms_norm [{t},7168]", 2 * x7.nbytes, lambda m, x7=x7, w7=w7: (
            lambda: m["norm"].v4_rms_norm(x7, w7, 1e-6))
        qh = torch.randn(t, 64, 512, device=dev, dtype=bf)
        pos = torch.arange(t, device=dev)
        inv = 1.0 / 10000 ** (torch.arange(0, 64, 2, device=dev).float() / 64)
        yield f"interleaved_rope [{t},64,512]", 2 * qh.nbytes, lambda m, qh=qh, pos=pos, inv=inv: (
            lambda: m["interleaved_rope"].interleaved_rope(qh, pos, inv, 1.0))
    for b in (1, 32, 256):
        part = torch.randn(b, 32, 8, 128, device=dev)
        lse = torch.randn(b, 32, 8, device=dev)
        out = torch.empty(b, 32, 128, device=dev, dtype=bf)

        def merge(m, part=part, lse=lse, out=out) -> Callable:
            def call():
                m["decode_attention"].merge_splits(part, lse, out)
                return out.clone()
            return call
        yield f"merge_splits [{b},32,8,128]", part.nbytes + lse.nbytes + out.nbytes, merge
    for t in (32, 4096):
        y = torch.randn(t * 8, 2048, device=dev, dtype=bf)
        slots = torch.randint(-1, 128, (t, 8), device=dev, dtype=torch.int32)
        yield f"sum_routes [{t}x8,2048]", y.nbytes + y.nbytes // 8, lambda m, y=y, s=slots: (
            lambda: m["fused_moe"]._sum_routes(y, s, 128))


def measure(before_tree: Path) -> dict:
    import torch
    from triton.testing import do_bench_cudagraph

    trees = {"before": load_tree(before_tree, "before"), "after": load_tree(Path("."), "after")}
    rate = copy_rate()
    rows = []
    for name, nbytes, make in cases():
        before, after = make(trees["before"]), make(trees["after"])
        a, b = before(), after()
        before_us = do_bench_cudagraph(before, rep=200) * 1e3
        after_us = do_bench_cudagraph(after, rep=200) * 1e3
        again_us = do_bench_cudagraph(before, rep=200) * 1e3
        rows.append(dict(case=name, before_us=before_us, after_us=after_us,
                         before_again_us=again_us, bound_us=nbytes / rate * 1e6,
                         identical=bool(torch.equal(a, b)),
                         max_abs_diff=float((a.float() - b.float()).abs().max())))
        print(f"{name:32s} before {before_us:8.2f} us (again {again_us:8.2f})  after "
              f"{after_us:8.2f} us  after/before {after_us / before_us:5.3f}  "
              f"bound {rows[-1]['bound_us']:7.2f} us  identical={rows[-1]['identical']}",
              flush=True)
    return dict(device=torch.cuda.get_device_name(), copy_rate_gb_s=rate / 1e9, rows=rows)


def plot(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((folder / "kernel_compare.json").read_text())
    rows = data["rows"]
    names = [r["case"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["after_us"] / r["before_us"] for r in rows], 0.4,
            label="after / before")
    ax.barh([y - 0.2 for y in ys], [r["before_again_us"] / r["before_us"] for r in rows], 0.4,
            color="tab:gray", label="before, timed again / before")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.set_xlim(0.8, 1.2)
    ax.invert_yaxis()
    ax.set_xlabel("time per call, relative to the before tree")
    ax.set_title(f"Row-wise kernels, two trees ({data['device']})", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(folder / "kernel_compare.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", nargs="?", type=Path)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda/kernel_compare"))
    parser.add_argument("--plot", type=Path, help="only plot the JSON in this folder")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
        return
    if args.before is None:
        parser.error("BEFORE_TREE is required unless --plot is given")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_compare.json").write_text(json.dumps(measure(args.before), indent=1))
    try:
        plot(args.out)
    except ImportError:  # no matplotlib on the GPU machine: plot here with --plot
        pass


if __name__ == "__main__":
    main()
