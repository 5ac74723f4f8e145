"""Expert parallelism over gloo, several rank processes on this machine: each rank holds a
share of the experts (plus replicas) and runs attention for its own prompts; every MoE layer
exchanges tokens. Outputs must equal the single-process model's, idle ranks must keep stepping
(dummy steps) without deadlock, and an EPLB rebalance mid-generation must not change a token."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer.core.accelerator import ParallelContext
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.sampling import SamplingParams
from deepinfer.llm import LLM
from tests.checkpoints import make_checkpoint
from tests.spawned import free_port, spawn_ranks

TIMEOUT_S = 240


@dataclass(frozen=True)
class RankJob:
    path: str
    rank: int
    world_size: int
    port: int
    prompts: list[list[int]]  # this rank's prompts (attention DP: each rank its own)
    max_tokens: int = 24
    redundant: int = 0
    rebalance_at: tuple[int, ...] = ()  # loop iterations at which every rank rebalances
    chunk: int = 2048
    all_to_all_min_tokens: int | None = None  # None: the runtime's default


@dataclass
class RankResult:
    tokens: list[list[int]]
    dummy_steps: int
    reports: list = field(default_factory=list)
    placements: list = field(default_factory=list)


def _run_rank(job: RankJob, out: mp.Queue) -> None:
    import torch.distributed as dist

    from deepinfer.backends.cpu.accelerator import CPUAccelerator
    from deepinfer.core.engine import Engine
    from deepinfer.serve.ranks.engine_proc import StepClock, _step
    from deepinfer.serve.ranks.lockstep import Lockstep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=job.rank,
                            world_size=job.world_size)
    context = ParallelContext(job.rank, job.world_size, dist.group.WORLD, True, job.redundant)
    config = EngineConfig(ModelSpec(job.path, dtype="float32"),
                          CacheConfig(block_size=16, num_blocks=64),
                          SchedulerConfig(max_num_batched_tokens=job.chunk), seed=0)
    engine = Engine(config, CPUAccelerator(), load_tokenizer=False, parallel=context)
    if job.all_to_all_min_tokens is not None:
        engine.accelerator.runner.moe.all_to_all_min_tokens = job.all_to_all_min_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(job.prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(job.prompts))}
    result = RankResult([], 0)
    lockstep, clock, iteration = Lockstep(), StepClock(), 0
    while True:
        if iteration in job.rebalance_at:
            result.placements.append(engine.accelerator.runner.moe.placement.phy2log.tolist())
            result.reports.append(engine.rebalance_experts())
        for o in _step(engine, clock, lockstep):
            tokens[o.request_id] += o.new_token_ids
        iteration += 1
        if not lockstep.peers_busy:
            break
    result.tokens = [tokens[f"r{i}"] for i in range(len(job.prompts))]
    result.dummy_steps = engine.num_dummy_steps
    dist.destroy_process_group()
    out.put((job.rank, result))


def run_ranks(jobs: list[RankJob]) -> list[RankResult]:
    return spawn_ranks(_run_rank, [(job,) for job in jobs], TIMEOUT_S)


def _port() -> int:
    return free_port()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 250, (int(length),), generator=g).tolist()
            for length in torch.randint(4, 40, (n,), generator=g)]


def _single_process(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(path, dtype="float32", accelerator="cpu", block_size=16, kv_cache_memory_gb=0.05,
              load_tokenizer=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: make_checkpoint(str(tmp_path_factory.mktemp(family)), family)
            for family in ("qwen3_moe", "deepseek_v3_moe")}


# all_to_all_min_tokens 8: prefill steps exchange all-to-all, decode steps all-gather.
@pytest.mark.parametrize("family, world_size, redundant, a2a", [
    ("qwen3_moe", 2, 0, None), ("qwen3_moe", 4, 0, 8), ("deepseek_v3_moe", 2, 2, 8)])
def test_expert_parallel_equals_one_process(checkpoints, family, world_size, redundant, a2a):
    path = checkpoints[family]
    prompts = _prompts(2 * world_size, seed=world_size)
    expected = _single_process(path, prompts, 24)
    port = _port()
    jobs = [RankJob(path, r, world_size, port, prompts[2 * r:2 * r + 2], redundant=redundant,
                    all_to_all_min_tokens=a2a) for r in range(world_size)]
    results = run_ranks(jobs)
    got = [tokens for result in results for tokens in result.tokens]
    assert got == expected


def test_idle_rank_runs_dummy_steps_without_deadlock(checkpoints):
    path = checkpoints["qwen3_moe"]
    prompt = _prompts(1, seed=7)
    port = _port()
    jobs = [RankJob(path, 0, 2, port, prompt, max_tokens=100), RankJob(path, 1, 2, port, [])]
    busy, idle = run_ranks(jobs)
    assert busy.tokens == _single_process(path, prompt, 100)
    assert idle.dummy_steps >= 100 and busy.dummy_steps == 0


def test_rebalance_mid_generation_keeps_every_token(checkpoints):
    path = checkpoints["deepseek_v3_moe"]
    prompts = _prompts(4, seed=3)
    expected = _single_process(path, prompts, 32)
    port = _port()
    jobs = [RankJob(path, r, 2, port, prompts[2 * r:2 * r + 2], max_tokens=32, redundant=2,
                    rebalance_at=(10, 20)) for r in range(2)]
    results = run_ranks(jobs)
    assert [t for r in results for t in r.tokens] == expected
    first, second = results[0].reports
    assert first.window_tokens > 0 and first.experts_moved > 0
    assert first.imbalance_after <= first.imbalance_before
    # every rank decided the same placement, and it is not the initial one
    assert results[0].placements[1] == results[1].placements[1]
    assert results[0].placements[0] != results[0].placements[1]


def _fp8_slot_contents(seed: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every physical slot's w13 in FP8 (codes as bytes, scales): what rank r holds first is
    slots [2r, 2r + 2)."""
    from deepinfer.models.quant.tensors import RowScaledFP8
    g = torch.Generator().manual_seed(seed)
    parts = [RowScaledFP8.quantize(torch.randn(64, 256, generator=g), block_rows=128)
             for _ in range(slots)]
    return (torch.stack([p.weight.view(torch.uint8) for p in parts]),
            torch.stack([p.scale for p in parts]))


def _move_fp8_experts(rank: int, port: int, sources: list[int], out: mp.Queue) -> None:
    import torch.distributed as dist

    from deepinfer.models.moe.layer import MoEBlock, MoEDims
    from deepinfer.models.moe.routing import RouterSpec
    from deepinfer.models.moe.runtime import ExpertRuntime
    from deepinfer.models.quant.plan import apply_plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    runtime = ExpertRuntime(1, 4, ParallelContext(rank, 2, dist.group.WORLD, True, 0))
    block = MoEBlock(MoEDims(256, 32, RouterSpec(4, 2)), 0, None, runtime)  # no ops: nothing runs
    apply_plan(block, {"w13": "fp8", "w2": "fp8"})
    codes, scales = _fp8_slot_contents(0, 4)
    mine = slice(2 * rank, 2 * rank + 2)
    block.w13.weight.view(torch.uint8).copy_(codes[mine])
    block.w13.scale.copy_(scales[mine])
    block.move_experts(torch.tensor(sources[mine]), runtime)
    # numpy: a tensor on the queue would be shared memory the exiting rank takes with it
    out.put((rank, (block.w13.weight.view(torch.uint8).numpy(), block.w13.scale.numpy(),
                    str(block.w13.weight.dtype))))
    dist.destroy_process_group()


def test_fp8_experts_move_as_fp8_under_eplb():
    """A rebalance moves FP8 experts between ranks (gloo) as they are: each slot gets the
    codes and scales of the old slot it takes, and stays float8."""
    sources = [3, 0, 2, 1]  # new slot i takes old physical slot sources[i]
    port = _port()
    results = spawn_ranks(_move_fp8_experts, [(r, port, sources) for r in range(2)], 60)
    codes, scales = _fp8_slot_contents(0, 4)
    for rank, (got_codes, got_scales, dtype) in enumerate(results):
        assert dtype == str(torch.float8_e4m3fn)
        taken = sources[2 * rank:2 * rank + 2]
        assert torch.equal(torch.from_numpy(got_codes), codes[taken])
        assert torch.equal(torch.from_numpy(got_scales), scales[taken])


def _break_off_a_rebalance(rank: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    from deepinfer.models.moe.layer import MoEBlock, MoEDims
    from deepinfer.models.moe.routing import RouterSpec
    from deepinfer.models.moe.runtime import ExpertRuntime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    context = ParallelContext(rank, 2, dist.group.WORLD, True, 0)
    runtime = ExpertRuntime(2, 4, context)
    blocks = [MoEBlock(MoEDims(64, 32, RouterSpec(4, 2)), layer, None, runtime)
              for layer in range(2)]
    skewed = torch.tensor([[100, 90, 1, 1]] * 2)  # experts 0 and 1 both on rank 0: both move
    runtime.load.copy_(skewed)
    report = runtime.rebalance()
    runtime.rebind(context)  # a whole rebalance: the rank may keep its model

    def broken(sources, rt):  # the group breaks off while the second layer moves
        raise RuntimeError("Connection reset by peer")

    blocks[1].move_experts = broken
    runtime.load.copy_(skewed.flip(1))
    try:
        runtime.rebalance()
    except RuntimeError:
        pass
    try:
        runtime.rebind(context)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    out.put((rank, (report.experts_moved, refused)))
    dist.destroy_process_group()


def test_a_rank_whose_rebalance_broke_off_cannot_rejoin_a_group():
    """A group that breaks off mid-rebalance leaves each rank's experts half moved: a survivor
    may not keep that model in a regroup (it exits and the whole group restarts)."""
    port = _port()
    results = spawn_ranks(_break_off_a_rebalance, [(r, port) for r in range(2)], 60)
    for moved, refused in results:
        assert moved > 0
        assert "broke off an expert rebalance mid-move" in refused
