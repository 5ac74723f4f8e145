"""Whole-engine correctness of the CUDA backend on a GPU, against transformers on the same GPU.

    python benchmarks/cuda/check_engine.py [--out DIR]

1. The backend conformance suite (deepinfer.testing.conformance) on CUDAAccelerator.
2. Greedy tokens of the engine (chunked prefill, decode graphs, a prefix-cache hit, each prompt
   alone at batch 1) equal transformers' greedy generate, float32, on random-weight llama,
   qwen3, mistral (sliding window 48, prompts to 300), qwen3 with sliding and full layers (two KV
   groups) and dense deepseek_v3 (MLA) checkpoints.
3. bfloat16: relative error of every prompt token's logits against transformers in bfloat16.
4. HiCache through the engine: a conversation evicted between turns decodes the same tokens
   with the host tier (UVA page copy) on and off, and with the disk tier behind it, across a
   restart.
Exits nonzero on any failure; prints one line per check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.backends.cuda.accelerator import CUDAAccelerator  # noqa: E402
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig  # noqa: E402
from deepinfer.core.engine import Engine  # noqa: E402
from deepinfer.core.sampling import SamplingParams  # noqa: E402
from deepinfer.testing.conformance import run_conformance  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402

SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                  max_position_embeddings=1024, initializer_range=0.05),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                  max_position_embeddings=1024, initializer_range=0.05),
    # Sliding window well below the longest prompt: decode reads only the window.
    "mistral": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                    max_position_embeddings=1024, initializer_range=0.05, sliding_window=48),
    # Layer 0 full, layer 1 and 2 a 48-token window: two KV groups, each layer its own tables.
    "qwen3_windowed": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                           max_position_embeddings=1024, initializer_range=0.05,
                           use_sliding_window=True, sliding_window=48, max_window_layers=1),
    # MLA: the paged latent cache and the MLA kernels.
    "deepseek_v3": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                        num_attention_heads=4, vocab_size=1024, max_position_embeddings=1024,
                        initializer_range=0.05),
    # MoE: the fused MoE kernel and the router of each family.
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                      max_position_embeddings=1024, initializer_range=0.05,
                      moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4),
    "mixtral": dict(hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                    max_position_embeddings=1024, initializer_range=0.05),
    # Two shared experts: with DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=1, two slots of the fused MoE.
    "deepseek_v3_moe": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=4, vocab_size=1024, max_position_embeddings=1024,
                            initializer_range=0.05, moe_intermediate_size=128,
                            n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                            n_shared_experts=2),
    # DeepSeek-V2-Lite's attention: q_proj without a q_lora rank (its rows beside kv_a's in one
    # fused projection).
    "deepseek_v2_moe": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=4, vocab_size=1024, max_position_embeddings=1024,
                            initializer_range=0.05, moe_intermediate_size=128,
                            n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                            n_shared_experts=2, q_lora_rank=None),
}
# The transformers family each SHAPES entry is written with, where its name is not one.
FAMILY_OF = {"qwen3_windowed": "qwen3", "deepseek_v2_moe": "deepseek_v3_moe"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3_moe", "deepseek_v2_moe")
PROMPT_LENS = (5, 23, 41, 100, 300)
NEW_TOKENS = 48


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the top-2 logit margin at each step."""
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def forced_greedy(model, prompt: list[int], ours: list[int]) -> tuple[list[int], list[float]]:
    """The reference's argmax after the prompt and each of our tokens (one full forward), and
    its top-2 margin there."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours], device="cuda")).logits[0]
    logits = logits[len(prompt) - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(dim=-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def engine_greedy(path: str, prompts: list[list[int]], block_size: int) -> list[list[int]]:
    config = EngineConfig(
        model=ModelSpec(path, dtype="float32"),
        cache=CacheConfig(block_size=block_size, gpu_memory_utilization=0.3),
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8),
        accelerator="nvidia")
    engine = Engine(config, load_tokenizer=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    def run(round_: int, group: list[int]) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        for i in group:
            engine.add_request(f"{round_}-{i}", prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.token_ids)
        return outputs

    everyone = list(range(len(prompts)))
    results = []
    for round_ in range(2):  # the second round hits the prefix cache of the first
        outputs = run(round_, everyone)
        results.append([outputs[f"{round_}-{i}"] for i in everyone])
    # Each prompt alone: batch-1 decode steps (the fused one-token GEMVs in the graph).
    results.append([run(2, [i])[f"2-{i}"] for i in everyone])
    engine.shutdown()
    assert results[0] == results[1], "outputs changed on a prefix-cache hit"
    assert results[0] == results[2], "outputs of a lone request differ from the batched ones"
    return results[0]


def _checkpoint(path: str, family: str, dtype: torch.dtype) -> str:
    """SHAPES[family]'s random checkpoint, written by the transformers family FAMILY_OF names
    (`qwen3_windowed`: sliding and full layers, two KV groups)."""
    return make_checkpoint(path, FAMILY_OF.get(family, family), dtype, **SHAPES[family])


def check_greedy(family: str, block_size: int, workdir: str) -> dict:
    import transformers

    path = _checkpoint(os.path.join(workdir, f"{family}-fp32"), family, torch.float32)
    g = torch.Generator().manual_seed(7)
    vocab = SHAPES[family]["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ours = engine_greedy(path, prompts, block_size)
    exact, tied = 0, 0
    for prompt, got in zip(prompts, ours):
        # MoE: the reference's own generate() drifts from its full forward (Mixtral's cached
        # path flips tokens with wide margins), so ours is checked teacher-forced.
        want, margins = (forced_greedy(model, prompt, got) if family in MOE_FAMILIES
                         else hf_greedy(model, prompt))
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            exact += 1
        elif margins[first] < 1e-3:
            tied += 1  # a near-tie in the reference: either token is a correct greedy choice
        else:
            raise AssertionError(f"{family}: prompt of {len(prompt)} tokens diverges at token "
                                 f"{first} (reference margin {margins[first]:.4f}): "
                                 f"{got[:first + 2]} vs {want[:first + 2]}")
    return {"family": family, "block_size": block_size, "exact": exact, "near_tie": tied,
            "prompts": len(prompts)}


def check_bf16_logits(family: str, workdir: str) -> dict:
    import transformers

    from deepinfer.core.batch import GroupBatch, ModelBatch

    path = _checkpoint(os.path.join(workdir, f"{family}-bf16"), family, torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    acc = CUDAAccelerator()
    acc.init_device()
    acc.load_model(ModelSpec(path, dtype="bfloat16"))
    acc.allocate_kv_cache(64, 16)  # allocation only: no warm-up, no graphs
    prompt = torch.randint(3, SHAPES[family]["vocab_size"], (300,)).tolist()
    blocks = list(range(40, 40 + 19))[::-1]  # non-contiguous, reversed block table
    slots = [blocks[p // 16] * 16 + p % 16 for p in range(300)]
    # One chunk: every KV group (a sliding group too) holds all of its pages.
    groups = (GroupBatch([blocks], slots),) * acc.info.kv_spec.num_groups
    batch = ModelBatch(input_ids=prompt, positions=list(range(300)), query_lens=[300],
                       seq_lens=[300], groups=groups, sample_indices=[0], sampling=[])
    ours = acc.forward_logits(batch, all_tokens=True)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref_cpu = model(ids).logits[0].float().cuda()
        model.cuda()
        ref = model(ids.cuda()).logits[0].float()
        exact = model.float()(ids.cuda()).logits[0]  # the same bf16 weights, computed in fp32
    rel = float((ours - ref).norm() / ref.norm())
    acc.shutdown()
    # MoE: a bf16 rounding that flips a router choice changes a token's output outright, in
    # transformers' bf16 run as in ours; both are held to the fp32 computation instead. How
    # many routes flip is the luck of each platform's GEMM rounding (transformers' own error on
    # one checkpoint differs between a GPU and the CPU: docs/benchmarks.md), so the reference's
    # error is the larger of its runs on the GPU and on the CPU.
    ours_err = float((ours - exact).norm() / exact.norm())
    ref_gpu_err, ref_cpu_err = (float((r - exact).norm() / exact.norm()) for r in (ref, ref_cpu))
    ref_err = max(ref_gpu_err, ref_cpu_err)
    bound = max(2e-2, 1.5 * ref_err) if family in MOE_FAMILIES else 2e-2
    if not (ours_err if family in MOE_FAMILIES else rel) < bound:
        raise AssertionError(f"{family} bf16 logits relative error {rel:.3e} (vs fp32: ours "
                             f"{ours_err:.3e}, transformers bf16 {ref_gpu_err:.3e} on the "
                             f"GPU, {ref_cpu_err:.3e} on the CPU)")
    return {"family": family, "bf16_logits_rel_err": rel, "vs_fp32_ours": ours_err,
            "vs_fp32_transformers_bf16": ref_gpu_err,
            "vs_fp32_transformers_bf16_cpu": ref_cpu_err}


def check_hicache(workdir: str) -> dict:
    """HiCache through the engine on the GPU: the UVA copy kernel stores and loads the pages of a
    conversation that another user's prompt evicts; greedy tokens equal the run without it."""
    from deepinfer.testing.hicache import check_disk_tier, check_host_tier, check_shared_pool

    path = make_checkpoint(os.path.join(workdir, "hicache"), "llama", torch.float32,
                           **SHAPES["llama"])
    stats = check_host_tier(path, CUDAAccelerator, vocab=SHAPES["llama"]["vocab_size"])
    # The disk tier behind it: pages written back from the pinned pool, read into it again by
    # a new engine (a restart) over the same folder.
    first, restarted = check_disk_tier(path, CUDAAccelerator, SHAPES["llama"]["vocab_size"],
                                       os.path.join(workdir, "hicache-disk"))
    # Two engines (ranks) over one pool in shared memory, mapped and registered for the GPU by
    # each: a conversation's turns alternate between them.
    # Shared memory, as the server's: a file on a disk file system cannot be page-locked.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        shared = check_shared_pool(path, CUDAAccelerator, SHAPES["llama"]["vocab_size"], folder)
    # Every tier on and off for a sliding-window model, one with a full and windowed layers
    # (two KV groups) and MLA: the host tier and the shared pool give the tokens of no cache.
    families = {}
    for family in ("mistral", "qwen3_windowed", "deepseek_v3"):
        fpath = _checkpoint(os.path.join(workdir, f"hicache-{family}"), family, torch.float32)
        host = check_host_tier(fpath, CUDAAccelerator, vocab=SHAPES[family]["vocab_size"])
        with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
            pooled = check_shared_pool(fpath, CUDAAccelerator, SHAPES[family]["vocab_size"],
                                       folder)
        families[family] = {"host_hit_tokens": host.host_hit_tokens,
                            "shared_pool_host_hit_tokens": [p.host_hit_tokens for p in pooled]}
        print(f"hicache {family}: {families[family]}", flush=True)
    return {"families": families,
            "host_hit_tokens": stats.host_hit_tokens, "loaded_pages": stats.loaded_pages,
            "stored_pages": stats.stored_pages,
            "shared_pool_host_hit_tokens": [s.host_hit_tokens for s in shared],
            "disk_written_pages": first.disk.written_pages,
            "disk_read_pages_after_restart": restarted.disk.read_pages,
            "restart_cached_tokens": restarted.cached_tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-conformance", action="store_true")
    parser.add_argument("--families", nargs="+", default=list(SHAPES))
    parser.add_argument("--hicache-only", action="store_true",
                        help="only the HiCache checks (host, disk, shared pool)")
    args = parser.parse_args()
    report: dict = {"gpu": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_conformance:
            run_conformance(CUDAAccelerator, os.path.join(workdir, "conformance"))
            print("conformance suite: passed", flush=True)
        report["greedy"], report["bf16"] = [], []
        for family in args.families if not args.hicache_only else ():
            for block_size in (16, 128):
                report["greedy"].append(check_greedy(family, block_size, workdir))
                print("greedy vs transformers:", report["greedy"][-1], flush=True)
            report["bf16"].append(check_bf16_logits(family, workdir))
            print("bf16 logits:", report["bf16"][-1], flush=True)
        report["hicache"] = check_hicache(workdir)
        print("hicache through the engine:", report["hicache"], flush=True)
    if args.out:
        name = "cuda_check_hicache" if args.hicache_only else \
            "cuda_check_engine" if args.families == list(SHAPES) else "cuda_check_moe"
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
