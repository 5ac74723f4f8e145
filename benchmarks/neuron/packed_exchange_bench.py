"""The route exchange of one MoE layer under expert parallel, gloo ranks on this CPU: ONE packed
[T, 2k+1] float32 all-gather (ids | weights | valid, deepinfer/backends/neuron/moe.py, pack and
unpack included) against three separate all-gathers (ids int32 [T, k], weights float32 [T, k],
valid bool [T]: nearly the same bytes, so the difference is the number of collectives).

    python benchmarks/neuron/packed_exchange_bench.py [--worlds 2 4 8] [--tokens 1 8 64 512 4096]

Each rank process runs both variants alternately (the order flips every iteration), a barrier
before each; an iteration's latency is the slowest rank's (the layer waits for it); the median
over iterations is reported. Ranks beyond the cores share them (the machine is recorded).
Writes benchmarks/results/neuron/packed_exchange.json and packed_exchange.png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import RESULTS_DIR, free_port, log, machine_environment, percentile, pyplot, write_json  # noqa: E402

K = 8
SLOTS = 128  # physical slots the ids range over (Qwen3-30B-A3B's experts)


def _variants(tokens: int, world: int):
    """(name -> a callable running one layer's route exchange) on this rank's routes."""
    import torch
    import torch.distributed as dist

    from deepinfer.backends.neuron.moe import pack_routes, unpack_routes
    from deepinfer.models.moe.exchange import all_gather

    g = torch.Generator().manual_seed(dist.get_rank())
    phys = torch.rand(tokens, SLOTS, generator=g).topk(K, dim=1).indices
    weights = torch.rand(tokens, K, generator=g)
    ids32, valid = phys.to(torch.int32), torch.ones(tokens, dtype=torch.bool)

    def gather(t):
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        all_gather(out, t)
        return out

    def packed():
        return unpack_routes(gather(pack_routes(phys, weights, tokens, tokens)), K)

    def separate():
        return gather(ids32).long(), gather(weights), gather(valid)
    return {"packed": packed, "separate": separate}


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, warmup: int,
          out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    times: dict[int, dict[str, list[float]]] = {}
    for tokens in sizes:
        variants = _variants(tokens, world)
        times[tokens] = {name: [] for name in variants}
        for i in range(warmup + iters):
            for name in sorted(variants, reverse=bool(i % 2)):
                dist.barrier()
                start = time.perf_counter()
                variants[name]()
                if i >= warmup:
                    times[tokens][name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    out.put((rank, times))


def run_world(world: int, sizes: list[int], iters: int, warmup: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, iters, warmup, out))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {str(t): _summary([per_rank[r][t] for r in range(world)]) for t in sizes}


def _summary(ranks: list[dict[str, list[float]]]) -> dict:
    row: dict = {}
    for name in ranks[0]:
        slowest = [max(r[name][i] for r in ranks) * 1e6 for i in range(len(ranks[0][name]))]
        row[name] = {"median_us": statistics.median(slowest),
                     "p90_us": percentile(slowest, 90), "raw_us": slowest}
    row["speedup"] = row["separate"]["median_us"] / row["packed"]["median_us"]
    return row


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    worlds = list(result["worlds"])
    fig, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 3.8), sharey=True)
    for ax, world in zip(axes if len(worlds) > 1 else [axes], worlds):
        rows = result["worlds"][world]
        sizes = [int(t) for t in rows]
        for name, label in (("packed", "1 packed gather"), ("separate", "3 gathers")):
            ax.plot(sizes, [rows[str(t)][name]["median_us"] for t in sizes], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{world} gloo ranks")
        ax.set_xlabel("tokens per rank (k=8)")
    axes_list = axes if len(worlds) > 1 else [axes]
    axes_list[0].set_ylabel("route exchange per MoE layer, median µs")
    axes_list[0].legend()
    fig.suptitle(f"packed route all-gather vs three, CPU gloo "
                 f"({result['machine']['logical_cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "neuron"))
    args = parser.parse_args()
    result = {"k": K, "slots": SLOTS, "iters": args.iters, "machine": machine_environment(),
              "worlds": {}}
    for world in args.worlds:
        log(f"{world} ranks ...")
        result["worlds"][str(world)] = run_world(world, args.tokens, args.iters, args.warmup)
        for t, row in result["worlds"][str(world)].items():
            print(f"world {world} T {t:>5}: packed {row['packed']['median_us']:9.1f} us  "
                  f"separate {row['separate']['median_us']:9.1f} us  x{row['speedup']:.2f}")
    path = write_json(os.path.join(args.out, "packed_exchange.json"), result)
    plot(result, os.path.splitext(path)[0] + ".png")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
