"""DeepSeek-V4 speculative decoding with its MTP layer on one H200: decode speed with k = 1..3
drafts against plain decoding (k = 0) of the same model in the same run, at a measured
acceptance rate.

    python benchmarks/cuda/v4_mtp_bench.py --out benchmarks/results/cuda [--tiny --accelerator cpu]

The model is v4_bench.py's (V4-Flash width, 4 layers, bf16) plus its MTP layer, every weight
random (dummy) but for what makes a known, tunable acceptance: random weights draft nothing
right. M = hidden_size tokens get one-hot embeddings; the attention and expert output
projections are zeroed, so the final hidden state is the last token's own (normed) one-hot and
the LM head, whose row chain[sigma(i)] is basis vector i, continues a chain: after chain[i]
comes chain[sigma(i)]. The MTP layer's e_proj is a permutation rho of the basis that fixes a
fraction `fixed` of it (h_proj zero): it drafts chain[sigma(rho(i))], right exactly where rho
fixes i. Every kernel still runs on full-size weights, so each step costs what a real model's
does; only the values are arranged. Output tokens per second of the decode phase (prompts of
512 chain tokens, greedy, ignore_eos), the acceptance rate from the engine's counters.
Writes v4_mtp.json and v4_mtp.png.

How much a draft saves depends on the model's depth: a draft step costs one layer and the LM
head, a verify step the whole model over k + 1 tokens (at batch 1 each verified token brings
its own 6 experts per layer). On the 4-layer model the MTP layer is a fifth of the weights;
in V4-Flash it is one of 44. `--full-depth` measures V4-Flash's own 43 layers (its layer and
MoE types) with --experts routed experts per layer instead of 256, so that the model fits one
GPU (~84 GB at 32): what a token reads at batch 1 (6 routed experts + the shared one, the
attention, the head) is V4-Flash's; at larger batches fewer experts are left unread.
Writes v4_mtp_full.json / .png then.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import pyplot  # noqa: E402
from v4_bench import v4_config  # noqa: E402

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402

PROMPT = 512


def tiny_config():
    """A small V4 for a CPU dry run of this script."""
    import transformers

    config = transformers.DeepseekV4Config(
        vocab_size=2048, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=4, index_head_dim=16, index_topk=8, sliding_window=16,
        n_routed_experts=8, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1)
    config.architectures = ["DeepseekV4ForCausalLM"]
    return config


@torch.no_grad()
def arrange(model, fixed: float, seed: int = 0) -> dict[int, int]:
    """The chain weights (module docstring); returns the chain: token -> the next one."""
    g = torch.Generator().manual_seed(seed)
    h, vocab = model.config.hidden_size, model.config.vocab_size
    dev = model.embed_tokens.weight.device
    chain = (torch.randperm(vocab - 2, generator=g)[:h] + 2).to(dev)
    basis = torch.arange(h, device=dev)
    sigma = torch.randperm(h, generator=g).to(dev)
    moved = torch.randperm(h, generator=g)[:round((1 - fixed) * h)].to(dev)
    rho = basis.clone()
    rho[moved] = moved.roll(1)  # a cycle over the moved ones: none of them is fixed
    model.embed_tokens.weight.zero_()[chain, basis] = 1
    model.lm_head.weight.zero_()[chain[sigma], basis] = 1
    mtp = model.mtp  # None for plain decoding (k = 0)
    for layer in [*model.layers, *([mtp.block] if mtp is not None else [])]:
        layer.self_attn.o_b_proj.weight.zero_()
        layer.mlp.w2.zero_()
        if layer.mlp.shared_experts is not None:
            layer.mlp.shared_experts.down_proj.weight.zero_()
    model.norm.weight.fill_(1)
    if mtp is not None:
        for norm in (mtp.norm, mtp.enorm, mtp.hnorm):
            norm.weight.fill_(1)
        mtp.e_proj.weight.zero_()[rho, basis] = 1
        mtp.h_proj.weight.zero_()
    return dict(zip(chain.tolist(), chain[sigma].tolist()))


def decode_rate(engine: Engine, prompts: list[list[int]], new: int, chain: dict[int, int]
                ) -> dict:
    """Output tokens per second once every prompt is in (its first token sampled), the
    acceptance counters of that run, and whether every output followed the chain (what plain
    decoding of these weights gives: speculative decoding must not change a token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    stats = engine.scheduler.spec_stats
    before = (stats.draft_tokens, stats.accepted_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, prefix_cache=False)
    produced, t0, steps, outputs = 0, None, 0, []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        steps += t0 is not None
        running = [s.request for s in engine._samples.values()]
        if t0 is None and all(r.output_token_ids for r in running):
            t0, produced = time.perf_counter(), sum(len(r.output_token_ids) for r in running)
    seconds = time.perf_counter() - t0
    drafts, accepted = stats.draft_tokens - before[0], stats.accepted_tokens - before[1]
    decoded = len(prompts) * new - produced
    return {"tok_s": decoded / seconds, "acceptance": accepted / drafts if drafts else None,
            "tokens_per_step": decoded / len(prompts) / max(steps, 1),
            "follows_chain": all(_follows(o.token_ids, chain) for o in outputs)}


def _follows(tokens: list[int], chain: dict[int, int]) -> bool:
    return all(chain.get(a) == b for a, b in zip(tokens, tokens[1:]))


def full_depth_config(experts: int):
    """V4-Flash's 43 layers (transformers' defaults) with `experts` routed experts a layer."""
    import transformers

    config = transformers.DeepseekV4Config(n_routed_experts=experts,
                                           max_position_embeddings=131072,
                                           bos_token_id=0, eos_token_id=1)
    config.architectures = ["DeepseekV4ForCausalLM"]
    config.torch_dtype = "bfloat16"
    return config


def bench(path: str, k: int, args) -> dict:
    config = EngineConfig(
        model=ModelSpec(path, dtype="bfloat16" if args.accelerator == "nvidia" else "float32",
                        max_model_len=4096, load_format="dummy"),
        cache=CacheConfig(gpu_memory_utilization=0.85, kv_cache_memory_gb=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max(args.batches),
                                  num_speculative_tokens=k),
        accelerator=args.accelerator)
    engine = Engine(config, load_tokenizer=False)
    model, out = engine.accelerator.runner.model, {}
    for fixed in args.fixed:
        chain = arrange(model, fixed)
        tokens = list(chain)
        g = torch.Generator().manual_seed(1)
        for batch in args.batches:
            prompts = [[tokens[i] for i in torch.randint(len(tokens), (PROMPT,), generator=g)]
                       for _ in range(batch)]
            # Warm-up of the same length: every step shape (the last steps' fewer drafts
            # run eagerly) compiles its kernels here, not in the measured run.
            decode_rate(engine, prompts, args.new, chain)
            got = decode_rate(engine, prompts, args.new, chain)
            out[f"fixed{fixed}_batch{batch}"] = got
            print(f"k={k} fixed={fixed} batch={batch}", got, flush=True)
        if k == 0:
            break  # plain decoding does not depend on the draft
    engine.shutdown()
    del engine, model
    gc.collect()  # the engine's reference cycles would keep its weights until then
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in result["batches"]:
        plain = next(r["tok_s"] for key, r in result["runs"]["0"].items()
                     if key.endswith(f"_batch{batch}"))  # k = 0 runs the first `fixed` only
        for fixed in result["fixed"]:
            ks = [k for k in result["ks"] if k]
            runs = [result["runs"][str(k)][f"fixed{fixed}_batch{batch}"] for k in ks]
            speed = [r["tok_s"] / plain for r in runs]
            ax.plot(ks, speed, marker="o", label=f"batch {batch}, draft layer right on "
                                                 f"{fixed:.0%} of tokens")
            for k, x, r in zip(ks, speed, runs):  # each point's measured acceptance
                ax.annotate(f"{r['acceptance']:.0%}", (k, x), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1.5, color="k", linestyle="dashed", linewidth=0.8)
    ax.set_xlabel("drafts per step (k)")
    ax.set_ylabel("decode tok/s / plain decoding")
    ax.set_title(f"DeepSeek-V4 MTP speculative decoding, {result.get('layers', 4)} layers, "
                 f"{result.get('routed_experts', 256)} experts (H200)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                 "cuda"))
    p.add_argument("--accelerator", default="nvidia")
    p.add_argument("--tiny", action="store_true", help="a small model (a CPU dry run)")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--fixed", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--full-depth", action="store_true",
                   help="V4-Flash's 43 layers with --experts routed experts each")
    p.add_argument("--experts", type=int, default=32)
    args = p.parse_args()
    path = tempfile.mkdtemp()
    config = tiny_config() if args.tiny else \
        full_depth_config(args.experts) if args.full_depth else v4_config()
    config.save_pretrained(path)
    result = {"ks": args.ks, "fixed": args.fixed, "batches": args.batches, "new": args.new,
              "prompt": PROMPT, "layers": config.num_hidden_layers,
              "routed_experts": config.n_routed_experts,
              "runs": {str(k): bench(path, k, args) for k in args.ks}}
    os.makedirs(args.out, exist_ok=True)
    name = "v4_mtp_full" if args.full_depth else "v4_mtp"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
