"""The batch-1 decode attention kernel as a decode graph runs it: rotary_decode_attention
(rotary + Qwen3 q/k norm + KV write + split-K attention + merge) at Qwen3-30B-A3B's heads
(32 query heads over 4 KV heads of 128, block 16), 48 launches back to back in one CUDA graph
(one a layer; PDL lets each launch ahead of the one before it finishing, as in the step).

    python benchmarks/cuda/bench_rotary_decode.py [--out rotary_decode.json] [--tag NAME]

Reports us per launch for each context and split count, and the compiled kernel's registers
and spills (a merge that holds every split's partials in registers spills). Run it from two
trees (PYTHONPATH) to compare kernels within one lease.
"""
from __future__ import annotations

import argparse
import json

import torch

from deepinfer.backends.cuda.kernels import rotary_decode
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters, rotary_decode_attention

HQ, HK, D, BLOCK, LAYERS = 32, 4, 128, 16, 48
CONTEXTS = (512, 2048, 8192)
SPLITS = (8, 16, 32)


def _inputs(context: int) -> dict:
    """One sequence of `context` keys over shuffled blocks, its new token in the last slot."""
    blocks = -(-context // BLOCK)
    table = (torch.randperm(blocks, device="cuda") + 1).to(torch.int32)[None]
    last = context - 1
    cache = lambda: torch.randn((blocks + 1) * BLOCK, HK, D, device="cuda",  # noqa: E731
                                dtype=torch.bfloat16)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda") / D)
    freqs = torch.outer(torch.arange(context + 1.0, device="cuda"), inv).repeat(1, 2)
    qkv = torch.randn(1, (HQ + 2 * HK) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    return dict(q=q.view(1, HQ, D), k=k.view(1, HK, D), v=v.view(1, HK, D),
                positions=torch.tensor([last], device="cuda"), cos=freqs.cos(), sin=freqs.sin(),
                k_cache=cache(), v_cache=cache(),
                slot_mapping=(table[0, last // BLOCK].long() * BLOCK + last % BLOCK).view(1),
                block_tables=table, seq_lens=torch.tensor([context], device="cuda",
                                                          dtype=torch.int32),
                block_size=BLOCK, scale=D ** -0.5, qk_norm=(norm, norm, 1e-6))


def _time_us(inputs: dict, splits: int) -> float:
    counters = SplitCounters()
    run = lambda: rotary_decode_attention(num_splits=splits, counters=counters,  # noqa: E731
                                          **inputs)
    run()  # compile, and allocate the tickets outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            run()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (10 * LAYERS))
    return sorted(times)[len(times) // 2]


def _kernel_resources() -> list[dict]:
    """Registers and spills of every compiled variant of the kernel (Triton's caches)."""
    found = []
    for caches in rotary_decode._rotary_decode_kernel.device_caches.values():
        for kernel in caches[0].values():
            found.append({"n_regs": getattr(kernel, "n_regs", None),
                          "n_spills": getattr(kernel, "n_spills", None),
                          "num_splits": kernel.src.constants.get("NUM_SPLITS")
                          if hasattr(kernel.src, "constants") else None})
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for context in CONTEXTS:
        inputs = _inputs(context)
        for splits in SPLITS:
            rows.append({"context": context, "splits": splits,
                         "us_per_launch": _time_us(inputs, splits)})
            print(f"{args.tag} context {context:5d} splits {splits:2d}: "
                  f"{rows[-1]['us_per_launch']:.2f} us", flush=True)
    resources = _kernel_resources()
    print(args.tag, "kernels:", resources)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tag": args.tag, "rows": rows, "kernels": resources,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
