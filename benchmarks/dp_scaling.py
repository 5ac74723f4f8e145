"""Does the server scale with its ranks? `deepinfer-serve --dp N` against `--dp 1` on the same
machine, the same streams per rank.

    python benchmarks/dp_scaling.py --dp 2 --per-rank 256,512 --prompt-len 512 --output-len 128 \\
        --client-procs 8 --out DIR -- --model DIR --accelerator nvidia --dtype bfloat16 ...

Everything after `--` goes to both servers as it is (model, accelerator, pool sizes); this script
adds `--dp`, `--routing least-loaded`, a port and a served name. One server at a time: start,
wait for /health, an untimed wave (the first level's streams, 8 tokens each), then per level
one wave of level x dp streaming /v1/completions sent at once (random prompt ids below --vocab,
EOS ignored, prefix cache off), dealt to --client-procs client processes
(serve_overhead's server wave: one Python client at a few hundred streams saturates its core
and times itself). Reports each side's output tok/s, TTFT p50/p99 and the CPU seconds of its
API processes and ranks and, per level, dp N / dp 1 (linear scaling: N). A stream that fails or
comes back short ends the run, so a finished run dropped none. Writes dp_scaling.json and .png.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    free_port,
    log,
    machine_environment,
    percentile,
    pyplot,
    random_prompts,
    start_server,
    stop_server,
    wait_healthy,
    write_json,
)
from serve_overhead import ClientProcesses, CpuMeter, server_wave  # noqa: E402

SERVED_NAME = "m"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ours, server = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="ranks of the scaled side")
    p.add_argument("--per-rank", default="256,512", help="comma-separated streams per rank")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below it")
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(ours)
    args.levels = [int(v) for v in args.per_rank.split(",")]
    args.server_args = server
    if args.dp < 2:
        p.error("--dp must be at least 2 (it is compared with --dp 1)")
    return args


def wave(base: str, prompts: list[list[int]], output_len: int, clients: ClientProcesses,
         meter: CpuMeter, trace_dir: str) -> dict:
    """serve_overhead's server wave (it raises if a stream fell short): output tok/s, TTFT and
    the CPU seconds of the API processes, the ranks and the clients."""
    w = server_wave(base, SERVED_NAME, prompts, output_len, len(prompts), 0, "httpx", meter,
                    trace_dir, clients)
    return {"streams": len(prompts), "wall_s": w.wall_s, "output_tokens": w.output_tokens,
            "output_tok_s": w.output_tok_s, "ttft_p50_ms": percentile(w.ttft_s, 50) * 1e3,
            "ttft_p99_ms": percentile(w.ttft_s, 99) * 1e3, "cpu_s": w.cpu}


def run_side(dp: int, args: argparse.Namespace, clients: ClientProcesses, workdir: str) -> dict:
    port = free_port()
    log_path = os.path.join(workdir, f"dp{dp}-{port}.log")
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--host", "127.0.0.1", "--port",
           str(port), "--dp", str(dp), "--routing", "least-loaded", "--served-model-name",
           SERVED_NAME, *args.server_args]
    proc = start_server(cmd, log_path, {"NCCL_NVLS_ENABLE": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        startup = wait_healthy(proc, base, log_path, timeout_s=args.start_timeout)
        log(f"--dp {dp}: up in {startup:.0f} s")
        timed = functools.partial(wave, base, clients=clients, meter=CpuMeter(proc.pid),
                                  trace_dir=tempfile.mkdtemp(dir=workdir))
        # the first level's batch, 8 tokens each: untimed
        timed(random_prompts(args.levels[0] * dp, args.prompt_len, args.vocab, seed=1), 8)
        rows = []
        for level in args.levels:
            prompts = random_prompts(level * dp, args.prompt_len, args.vocab, seed=level)
            row = {"per_rank": level, **timed(prompts, args.output_len)}
            log(f"--dp {dp}, {level} streams a rank: {row['output_tok_s']:.0f} out tok/s, "
                f"TTFT p50 {row['ttft_p50_ms']:.0f} ms")
            rows.append(row)
        return {"dp": dp, "startup_s": startup, "waves": rows}
    finally:
        stop_server(proc)


def ratios(one: dict, many: dict) -> list[dict]:
    return [{"per_rank": a["per_rank"], "tok_s_ratio": b["output_tok_s"] / a["output_tok_s"],
             "ttft_p50_ratio": b["ttft_p50_ms"] / a["ttft_p50_ms"]}
            for a, b in zip(one["waves"], many["waves"])]


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, (ax_tok, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for side in result["sides"]:
        levels = [w["per_rank"] for w in side["waves"]]
        label = f"--dp {side['dp']}"
        ax_tok.plot(levels, [w["output_tok_s"] for w in side["waves"]], "o-", label=label)
        ax_ttft.plot(levels, [w["ttft_p50_ms"] for w in side["waves"]], "o-", label=label)
    for r, side in zip(result["ratios"], result["sides"][1]["waves"]):
        ax_tok.annotate(f"x{r['tok_s_ratio']:.2f}", (r["per_rank"], side["output_tok_s"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_tok.set(xlabel="streams per rank", ylabel="output tok/s", title="throughput")
    ax_ttft.set(xlabel="streams per rank", ylabel="ms", title="TTFT p50")
    for ax in (ax_tok, ax_ttft):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"deepinfer-serve --dp {result['dp']} vs --dp 1 "
                 f"({result['prompt_len']}+{result['output_len']} tokens a stream)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="dp-scaling-")
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.client_procs) as pool:
        clients = ClientProcesses(pool, args.client_procs)
        sides = [run_side(dp, args, clients, workdir) for dp in (1, args.dp)]
    result = {"dp": args.dp, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "client_procs": args.client_procs, "server_args": args.server_args,
              "environment": machine_environment(), "sides": sides,
              "ratios": ratios(*sides), "seconds": time.perf_counter() - t0}
    path = os.path.join(args.out, "dp_scaling.json")
    write_json(path, result)
    plot(result, os.path.splitext(path)[0] + ".png")
    for r in result["ratios"]:
        log(f"{r['per_rank']} streams a rank: --dp {args.dp} / --dp 1 = "
            f"{r['tok_s_ratio']:.2f}x output tok/s, TTFT p50 x{r['ttft_p50_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
