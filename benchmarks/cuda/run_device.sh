#!/usr/bin/env bash
# Everything the CUDA backend needs checked and timed on a GPU, in one go (one device lease):
# kernel correctness and timings, the UVA page copy, the engine against transformers, and the
# Llama-3-8B-shape benchmark. Results land in ${OUT:-benchmarks/results/cuda}.
#   bash benchmarks/cuda/run_device.sh [STEP...]   (default: every step; --quick for a short bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results/cuda}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # absolute: some steps run from another tree
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEEPINFER_CACHE_DIR="${DEEPINFER_CACHE_DIR:-/tmp/deepinfer-cache}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kernel_tests attention gemv page_copy check_engine engine_bench mla_bench profile_steps)
wanted() { [[ " ${steps[*]} " == *" $1 "* ]]; }
quick=""
wanted --quick && quick="--quick"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
step() {  # step NAME CMD...: run, log, keep going on failure
  local name=$1; shift
  echo "=== $name"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$out/run_device.log" | tail -n 40 || { echo "!!! $name FAILED"; status=1; }
  echo "=== $name took $((SECONDS - t0)) s"
}
wanted kernel_tests && step kernel_tests python3 -m pytest -q -p no:cacheprovider tests/backends/cuda
wanted attention && step attention python3 benchmarks/cuda/bench_attention.py --out "$out/attention.json"
wanted gemm && step gemm python3 benchmarks/cuda/bench_gemm.py --out "$out/gemm.json"
wanted gemv && step gemv python3 benchmarks/cuda/bench_gemv.py --out "$out/gemv.json" $quick
wanted gemv_tiles && step gemv_tiles python3 benchmarks/cuda/bench_gemv.py --chain-tiles \
    --out "$out/gemv_tiles.json"
wanted page_copy && step page_copy python3 benchmarks/cuda/bench_page_copy.py --out "$out/page_copy.json"
wanted check_engine && step check_engine python3 benchmarks/cuda/check_engine.py --out "$out"
wanted check_greedy && step check_greedy python3 benchmarks/cuda/check_engine.py --out "$out" \
    --skip-conformance
wanted engine_bench && step engine_bench python3 benchmarks/cuda/engine_bench.py --out "$out" $quick \
    ${ENGINE_BENCH_ARGS:-}
wanted mla_bench && step mla_bench python3 benchmarks/cuda/mla_bench.py --out "$out" $quick
wanted check_moe && step check_moe python3 benchmarks/cuda/check_engine.py --out "$out" \
    --skip-conformance --families qwen3_moe mixtral deepseek_v3_moe deepseek_v2_moe
wanted moe_engine && step moe_engine python3 benchmarks/cuda/moe_engine_bench.py --out "$out" $quick
wanted moe_bench && step moe_bench python3 benchmarks/cuda/moe_bench.py --out "$out/fused_moe.json"
# The grouped GEMMs' tiles at the token counts of mixed steps (MOE_SWEEP_TOKENS), one shape.
wanted moe_sweep && step moe_sweep python3 benchmarks/cuda/moe_bench.py --sweep \
    --shapes ${MOE_SWEEP_SHAPES:-qwen3-30b-a3b} --sweep-tokens ${MOE_SWEEP_TOKENS:-2048 4096 8192} \
    --out "$out/fused_moe_sweep_mixed.json"
wanted moe_gemv_sweep && step moe_gemv_sweep python3 benchmarks/cuda/moe_bench.py \
    --out "$out/fused_moe.json" --gemv-sweep
wanted profile_moe && step profile_moe python3 benchmarks/cuda/profile_moe.py --out "$out" \
    --layers 12
wanted fp8 && step fp8_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_fp8_gemm.py
wanted fp8 && step fp8_gemm python3 benchmarks/cuda/bench_fp8.py --out "$out"
wanted fp8 && step fp8_engine python3 benchmarks/cuda/engine_bench.py --out "$out" --skip-hf \
    --quick --quantization fp8
wanted fp8 && step fp8_engine_bf16 python3 benchmarks/cuda/engine_bench.py --out "$out/bf16" \
    --skip-hf --quick
# The same FP8 engine with its prefill GEMMs on the Triton kernel instead of cuBLAS.
wanted fp8 && step fp8_engine_triton env DEEPINFER_CUDA_FP8_CUBLAS=0 python3 \
    benchmarks/cuda/engine_bench.py --out "$out/triton" --skip-hf --quick --quantization fp8
# The few-rows FP8 GEMM (decode batches of 2-32; swept to 64): its tests compiled, the sweep against
# cuBLAS's block-scaled GEMM, then the FP8 engine with it and without (DEEPINFER_CUDA_FP8_SKINNY=0,
# cuBLAS as before) alternately, separate processes, and bf16 in the same lease.
wanted fp8_skinny && step fp8_skinny_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_fp8_skinny.py tests/backends/cuda/test_fp8_gemm.py
wanted fp8_skinny && step fp8_skinny_bench python3 benchmarks/cuda/bench_fp8_skinny.py --out "$out" \
    $quick
for run in ${AB_RUNS:-1 2}; do
    for skinny in 1 0; do
        wanted fp8_skinny_ab && step "fp8_engine_skinny$skinny-$run" env \
            DEEPINFER_CUDA_FP8_SKINNY=$skinny python3 benchmarks/cuda/engine_bench.py \
            --out "$out/skinny$skinny-$run" --skip-hf --quick --quantization fp8
    done
done
wanted fp8_skinny_ab && step fp8_skinny_engine_bf16 python3 benchmarks/cuda/engine_bench.py \
    --out "$out/skinny_bf16" --skip-hf --quick
# FP8 experts: the kernels' tests on the GPU, the MoE layer in FP8 against bf16 (tile sweep
# first), the Qwen3-30B-A3B-shape engine with --quantization fp8 and without.
wanted fp8_moe && step fp8_moe_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_fused_moe_fp8.py tests/backends/cuda/test_fused_moe.py
wanted fp8_moe && step fp8_moe_bench python3 benchmarks/cuda/bench_moe_fp8.py --sweep \
    --out "$out/fused_moe_fp8.json"
wanted fp8_moe && step fp8_moe_engine python3 benchmarks/cuda/moe_engine_bench.py --skip-hf \
    --quick --quantization fp8 --out "$out"
wanted fp8_moe && step fp8_moe_engine_bf16 python3 benchmarks/cuda/moe_engine_bench.py \
    --skip-hf --quick --out "$out/moe_bf16"
# Shared experts as slots of the fused MoE against a dense MLP beside it
# (DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=1/0; DeepSeek-V2-Lite shape: two shared experts),
# alternately in one lease, separate processes; the greedy check with them fused first.
wanted shared_ab && step shared_check env DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=1 python3 \
    benchmarks/cuda/check_engine.py --out "$out" --skip-conformance --families deepseek_v3_moe
for run in ${AB_RUNS:-1 2}; do
    for fused in 1 0; do
        wanted shared_ab && step "shared_experts$fused-$run" env \
            DEEPINFER_CUDA_FUSED_SHARED_EXPERTS=$fused python3 benchmarks/cuda/moe_concurrency.py \
            --shape "${SHARED_SHAPE:-deepseek_v2_lite}" --workloads "${SHARED_WORKLOADS:-batch1,batch256}" \
            --tag "_shared$fused-$run" --out "$out/shared_experts"
    done
done
# MLA prefill expanded (kernels/mla_prefill.py) against the absorbed kernel: its tests on the GPU,
# both kernels timed alone with the expanded one's tile sweep, then the DeepSeek-V3 shape in FP8 with DEEPINFER_CUDA_MLA_EXPANDED_PREFILL=1/0, separate
# processes in one lease: the kernel breakdown (a mixed step with a 7,936-token chunk), then the
# workloads.
wanted mla_prefill_ab && step mla_prefill_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_mla_expanded_prefill.py tests/backends/cuda/test_mla_kernels.py
wanted mla_prefill_ab && step mla_prefill_bench python3 benchmarks/cuda/bench_mla_prefill.py \
    --sweep --out "$out/mla_prefill"
for expanded in 1 0; do
    wanted mla_prefill_ab && step "mla_prefill_profile$expanded" env \
        DEEPINFER_CUDA_MLA_EXPANDED_PREFILL=$expanded python3 benchmarks/cuda/moe_concurrency.py \
        --shape deepseek_v3 --quantization fp8 --profile --tag "_expanded$expanded" \
        --out "$out/mla_prefill"
    wanted mla_prefill_ab && step "mla_prefill_workloads$expanded" env \
        DEEPINFER_CUDA_MLA_EXPANDED_PREFILL=$expanded python3 benchmarks/cuda/moe_concurrency.py \
        --shape deepseek_v3 --quantization fp8 --workloads ${MLA_WORKLOADS:-batch1,batch256,mixed} \
        --tag "_expanded$expanded" --out "$out/mla_prefill"
done
# MLA decode alone at serving batch sizes, DeepSeek-V3's 128 heads and V2-Lite's 16, with its
# tile sweep (heads a program among them).
wanted mla_decode_tiles && step mla_decode_tiles python3 benchmarks/cuda/bench_mla_decode.py \
    --sweep --out "$out/mla_decode"
# DeepSeek-V3's widths in 3 layers, FP8 against bf16 at batch 1 and 256 streams, alternately in
# one lease (separate processes; each workload warms up untimed first).
for run in ${AB_RUNS:-1 2}; do
    for quant in fp8 auto; do
        wanted v3_fp8_ratio && step "v3_$quant-$run" python3 benchmarks/cuda/moe_concurrency.py \
            --shape deepseek_v3 --layers 3 --quantization $quant --workloads batch1,batch256 \
            --tag "_3layers-$run" --out "$out/v3_fp8_ratio"
    done
done
# Top-1 agreement of FP8 with bf16 on a real model: FP8_AGREEMENT_MODEL, SmolLM2's GGUF.
wanted fp8_agreement && step fp8_agreement python3 benchmarks/cuda/fp8_agreement.py \
    --model "${FP8_AGREEMENT_MODEL:?set FP8_AGREEMENT_MODEL to a .gguf or HF folder}" \
    --out "$out"
wanted gemv_preload && step gemv_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_gemv_kernels.py tests/backends/cuda/test_fused_moe.py
wanted gemv_preload && step gemv_chain python3 benchmarks/cuda/bench_gemv.py --moe-chain \
    --out "$out/gemv_preload.json"
# The engine at batch 1 with the GEMV's preload cut to one tile and whole (separate processes:
# the switch is read when the decode graphs are captured).
for run in 1a 0a 1b 0b; do
    wanted preload_engine && step "moe_engine_preload$run" env DEEPINFER_CUDA_GEMV_PRELOAD="${run:0:1}" \
        python3 benchmarks/cuda/moe_engine_bench.py --skip-hf --quick --out "$out/preload$run"
done
# Decode graphs that take their ids from the step in flight and end with the argmax: kernels
# compiled, greedy == transformers, then the engine before (an older tree, AB_BASELINE=DIR, e.g.
# `git archive COMMIT | tar -x -C DIR`) and after, alternately in one lease.
wanted graph_sampling && step graph_kernel_tests python3 -m pytest -q -p no:cacheprovider \
    tests/backends/cuda/test_decode_graph_kernels.py tests/backends/cuda/test_gemv_kernels.py
wanted graph_sampling && step graph_check_greedy python3 benchmarks/cuda/check_engine.py \
    --out "$out" --skip-conformance --families llama qwen3_moe
baseline() { (cd "$AB_BASELINE" && PYTHONPATH="$PWD:$PYTHONPATH" "$@"); }
for run in ${AB_RUNS:-1 2}; do
    wanted moe_ab && step "moe_engine_base$run" baseline python3 \
        benchmarks/cuda/moe_engine_bench.py --skip-hf --quick --out "$out/base$run"
    wanted moe_ab && step "moe_engine_new$run" python3 benchmarks/cuda/moe_engine_bench.py \
        --skip-hf --quick --out "$out/new$run"
done
# DeepSeek's decode launches before (AB_BASELINE, an older tree) and after, alternately in one
# lease: DeepSeek-V2-Lite at batch 1 and 256 streams (LAUNCH_WORKLOADS), then its breakdown.
for run in ${AB_RUNS:-1 2}; do
    wanted launch_ab && step "launch_base$run" baseline python3 benchmarks/cuda/moe_concurrency.py \
        --shape deepseek_v2_lite --workloads ${LAUNCH_WORKLOADS:-batch1,batch256} \
        --tag "_base$run" --out "$out/launch_ab"
    wanted launch_ab && step "launch_new$run" python3 benchmarks/cuda/moe_concurrency.py \
        --shape deepseek_v2_lite --workloads ${LAUNCH_WORKLOADS:-batch1,batch256} \
        --tag "_new$run" --out "$out/launch_ab"
done
# A 32K-token prompt through the server on the Llama-3-8B shape: cold, device hit and host-tier
# hit TTFT, then device hits under py-spy (server and ranks).
if wanted hit_ttft; then
    llama=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-8b --max-len 40960 \
        | tail -n 1)
    hits=(benchmarks/hit_ttft.py --tokens 32768 --vocab 128000)
    serve=(--model "$llama" --accelerator nvidia --dtype bfloat16 --load-format dummy
           --max-model-len 36864 --block-size 128 --num-kv-blocks 300 --hicache-size-gb 12
           --max-num-batched-tokens 8192 --tokenizer-backend hf --generation-config none
           --served-model-name m)
    step hit_ttft python3 "${hits[@]}" ${HIT_ARGS:---profile-hits 10} --out "$out/hit_ttft" -- "${serve[@]}"
    # The same server from an older tree (AB_BASELINE=DIR) under this client, where one is given.
    [ -n "${AB_BASELINE:-}" ] && step hit_ttft_base baseline python3 "$PWD/${hits[0]}" \
        "${hits[@]:1}" --out "$out/hit_ttft_base" -- "${serve[@]}"
fi
# HiCache through the engine on the GPU (host tier, disk tier, two engines over one shared
# pool: greedy tokens equal no cache for llama, mistral, a two-group qwen3 and deepseek_v3),
# then DeepSeek-V4's HiCache tests on the nvidia backend.
wanted hicache_checks && step hicache_check python3 benchmarks/cuda/check_engine.py \
    --skip-conformance --hicache-only --out "$out"
# USE_HUB_KERNELS=0: transformers >= 5.23 would otherwise ask for the `kernels` package
# (hub kernels, fetched over the network) as it loads the reference model.
wanted hicache_checks && step v4_hicache env DEEPINFER_ACCELERATOR=nvidia USE_HUB_KERNELS=0 \
    python3 -m pytest -q \
    -rs -p no:cacheprovider tests/models/test_deepseek_v4_hicache.py
# The 32K prompt's disk-tier hit (its files dropped from the page cache first), with a host
# tier large enough that write-back keeps every page of the prompt, and the disk tier's reads
# against plain reads on this machine's disk.
if wanted hit_ttft_disk; then
    llama=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-8b --max-len 40960 \
        | tail -n 1)
    step disk_tier python3 benchmarks/disk_tier.py --dir /tmp --out "$out/disk_tier"
    step hit_ttft_disk python3 benchmarks/hit_ttft.py --tokens 32768 --vocab 128000 --disk \
        ${HIT_ARGS:---repeats 1} --out "$out/hit_ttft_disk" -- --model "$llama" \
        --accelerator nvidia --dtype bfloat16 --load-format dummy --max-model-len 36864 \
        --block-size 128 --num-kv-blocks 300 --hicache-size-gb 24 --hicache-disk-gb 40 \
        --max-num-batched-tokens 8192 --tokenizer-backend hf --generation-config none \
        --served-model-name m
fi
# Agent sessions over the cache tiers at the Llama-3-8B shape: two ranks on the one GPU
# (--dp 2), affinity routing against least-loaded over the node's shared host pool and over a
# pool per rank (AGENT_SETTINGS, AGENT_ARGS and AGENT_SERVER_ARGS change the run).
if wanted agent_sessions; then
    llama=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-8b --max-len 16384 \
        | tail -n 1)
    step agent_sessions python3 benchmarks/agent_sessions.py \
        --settings "${AGENT_SETTINGS:-host,least,least_private}" ${AGENT_ARGS:---sessions 32 \
        --turns 6 --system 2048 --context 1024 --new 512 --output 128 --vocab 128000 \
        --host-gb 16} --out "$out/agent_sessions" --server-args "--model $llama \
        --accelerator nvidia --dtype bfloat16 --load-format dummy --block-size 128 \
        --max-model-len 16384 --tokenizer-backend hf --generation-config none \
        ${AGENT_SERVER_ARGS:---dp 2 --num-kv-blocks 750 --gpu-memory-utilization 0.45}"
fi
# The Llama-3-8B shape through the server and offline, the same prompts in one process pair on
# one GPU: 512-token random prompts, 128 output tokens, 1 / 64 / 256 streams.
if wanted serve_overhead; then
    llama=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-8b --max-len 8192 \
        | tail -n 1)
    step serve_overhead env DEEPINFER_ACCELERATOR=nvidia python3 benchmarks/serve_overhead.py \
        --model "$llama" --load-format dummy --dtype bfloat16 --levels "${SERVE_LEVELS:-1,64,256}" \
        --repeats "${SERVE_REPEATS:-1}" --prompt-len 512 --output-len 128 \
        --max-num-seqs "${SERVE_MAX_SEQS:-256}" --max-num-batched-tokens 8192 \
        --num-kv-blocks "${SERVE_KV_BLOCKS:-2048}" --client-procs "${SERVE_CLIENT_PROCS:-8}" \
        ${SERVE_ARGS:-} --out "$out/serve_overhead"
fi
# --dp 2 against --dp 1 through the server on two GPUs (nvidia-h200-x2): the Llama-3-8B shape,
# 512-token random prompts, 128 output tokens, 256 and 512 streams per GPU.
if wanted dp_scaling; then
    llama=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-8b --max-len 8192 \
        | tail -n 1)
    step dp_scaling python3 benchmarks/dp_scaling.py --dp 2 --per-rank "${DP_LEVELS:-256,512}" \
        --prompt-len 512 --output-len 128 --client-procs 8 --vocab 128000 --out "$out/dp_scaling" \
        -- --model "$llama" --accelerator nvidia --dtype bfloat16 --load-format dummy \
        --max-model-len 8192 --max-num-seqs 512 --max-num-batched-tokens 8192 \
        --num-kv-blocks 3000 --api-server-count "${DP_API_SERVERS:-2}" --tokenizer-backend hf \
        --generation-config none
fi
# The API tier's own ceiling: the same server benchmark on a 2-layer model of the Llama-3-8B
# width, whose steps are too short to be the limit, at up to 1,024 streams (a dropped stream
# fails the run), with one and with two API processes (API_SERVERS).
if wanted api_ceiling; then
    tiny=$(python3 benchmarks/cuda/engine_bench.py --write-model /tmp/llama3-2l --layers 2 \
        --max-len 8192 | tail -n 1)
    for n in ${API_SERVERS:-1 2}; do
        step "api_ceiling_$n" env DEEPINFER_ACCELERATOR=nvidia python3 \
            benchmarks/serve_overhead.py --model "$tiny" --load-format dummy --dtype bfloat16 \
            --levels "${API_LEVELS:-256,1024}" --repeats 1 --prompt-len 512 --output-len 128 \
            --max-num-seqs 1024 --max-num-batched-tokens 16384 --num-kv-blocks 6000 \
            --client-procs 8 --api-server-count "$n" ${SERVE_ARGS:-} \
            --out "$out/api_ceiling_$n"
    done
fi
# DeepSeek-V4: the engine on the GPU (decode graphs captured) against transformers on tiny
# checkpoints, the batch-1 step's profile, then the V4-Flash-width benchmark.
wanted v4_check && step v4_check env DEEPINFER_ACCELERATOR=nvidia python3 -m pytest -q \
    -p no:cacheprovider tests/models/test_deepseek_v4_hicache.py \
    tests/models/test_deepseek_v4_parity.py tests/models/test_deepseek_v4_mtp.py
wanted v4_mtp && step v4_mtp python3 benchmarks/cuda/v4_mtp_bench.py --out "$out" \
    ${V4_MTP_ARGS:-}
# Where a speculative step's time goes (k = 3 and 1, every draft accepted): kernels, GPU busy
# time against the step, the host's Python.
for k in ${V4_MTP_PROFILE_KS:-3 1}; do
    wanted v4_mtp_profile && step "v4_mtp_profile$k" python3 benchmarks/cuda/profile_v4.py \
        --out "$out" --speculative "$k"
done
wanted v4_profile && step v4_profile python3 benchmarks/cuda/profile_v4.py --out "$out"
wanted v4_bench && step v4_bench python3 benchmarks/cuda/v4_bench.py --out "$out" $quick \
    ${V4_BENCH_ARGS:-}
# DeepSeek-V4-Flash width through the server: cold / device-hit / host-tier-hit TTFT of one long
# prompt (V4_HIT_TOKENS, default 129024 then 32768), the device pool sized for one prompt.
if wanted v4_hit_ttft; then
    v4=$(python3 benchmarks/cuda/v4_bench.py --write-model /tmp/v4-flash | tail -n 1)
    for tokens in ${V4_HIT_TOKENS:-129024 32768}; do
        step "v4_hit_ttft_$tokens" python3 benchmarks/hit_ttft.py --tokens "$tokens" \
            --vocab 129280 --repeats "${V4_HIT_REPEATS:-1}" ${V4_HIT_ARGS:-} \
            --out "$out/v4_hit_ttft_$tokens" -- \
            --model "$v4" --accelerator nvidia --dtype bfloat16 --load-format dummy \
            --max-model-len 131072 --block-size 128 --num-kv-blocks $((tokens / 128 + 90)) \
            --hicache-size-gb 6 --max-num-batched-tokens 8192 --tokenizer-backend hf \
            --generation-config none --served-model-name m
    done
fi
# MoE at serving concurrency (moe_concurrency.py): each shape at batch 1/32/256 and the mixed
# closed-loop workload against the lease's bound, then the per-kernel breakdown of a 256-row
# decode step and a mixed step. MOE_SHAPES picks "shape[:fp8]" entries.
if wanted moe_concurrency; then
    for entry in ${MOE_SHAPES:-qwen3_30b_a3b qwen3_30b_a3b:fp8 deepseek_v2_lite llama3_8b deepseek_v3:fp8}; do
        shape=${entry%%:*}; quant=auto; [[ $entry == *:fp8 ]] && quant=fp8
        step "moe_concurrency_$entry" python3 benchmarks/cuda/moe_concurrency.py --shape "$shape" \
            --quantization "$quant" --server --out "$out/moe_concurrency" ${MOE_ARGS:-}
    done
fi
if wanted moe_profile; then
    for entry in ${MOE_SHAPES:-qwen3_30b_a3b deepseek_v2_lite}; do
        shape=${entry%%:*}; quant=auto; [[ $entry == *:fp8 ]] && quant=fp8
        step "moe_profile_$entry" python3 benchmarks/cuda/moe_concurrency.py --shape "$shape" \
            --quantization "$quant" --profile --out "$out/moe_concurrency"
    done
fi
wanted profile_steps && step profile_steps python3 benchmarks/cuda/profile_steps.py --out "$out"
# A whole 256 x (512+128) run: GPU busy time against the wall, kernels by kind, each step's host work.
wanted profile_run && step profile_run python3 benchmarks/cuda/profile_run.py --out "$out"
wanted profile_unfused && DEEPINFER_CUDA_GEMV=0 step profile_unfused \
    python3 benchmarks/cuda/profile_steps.py --out "$out" --batches 1 --tag unfused
exit $status
