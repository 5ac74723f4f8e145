"""The Neuron backend's static-shape MoE (deepinfer/backends/neuron/moe.py) on the host: packed
routes, counts and capacity; the grouped and dense paths against the reference experts; the
exchange over gloo ranks (grouped, dense, and an overflowing layer rerun dense) against one
process; exactly one route all-gather per layer; and a tiny Qwen3-MoE whose ops mix in
StaticMoEOps against the plain CPU ops."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

import pytest
import torch

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.backends.cpu.ops import CPUOps
from deepinfer.backends.neuron.env import DEFAULT_CAPACITY_FACTOR
from deepinfer.backends.neuron.moe import (
    CAPACITY_ENV,
    DECODE_MAX_TOKENS,
    StaticMoEExchange,
    StaticMoEOps,
    capacity_factor,
    capacity_for,
    dense_experts,
    expert_counts,
    grouped_experts,
    pack_routes,
    unpack_routes,
)
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.core.batch import GroupBatch, ModelBatch
from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.core.engine import Engine
from deepinfer.core.sampling import SamplingParams
from deepinfer.models.moe.experts import fused_experts_reference
from deepinfer.models.moe.routing import RouterSpec, select_experts
from tests.checkpoints import make_checkpoint
from tests.spawned import free_port, spawn_ranks

H, F, K, SLOTS_PER_RANK, LAYERS = 16, 8, 2, 4, 2
TIMEOUT_S = 120


class StaticCPUOps(StaticMoEOps, CPUOps):
    """What the Neuron backend's ops do for MoE, over the CPU backend's other ops."""


# ---- problems --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One MoE layer over `world` ranks: global expert weights, each rank's tokens and routes;
    rank r has T_r tokens of which the first real_r are real."""
    w13: torch.Tensor  # [P, 2F, H]
    w2: torch.Tensor  # [P, H, F]
    x: list[torch.Tensor]
    phys: list[torch.Tensor]
    weights: list[torch.Tensor]
    real: list[int]
    padded: int


def _distinct_slots(tokens: int, slots: int, g: torch.Generator) -> torch.Tensor:
    """k distinct slots per token, as top-k routing gives."""
    return torch.rand(tokens, slots, generator=g).topk(K, dim=1).indices


def _problem(world: int, layer: int, padded: int = 24) -> Problem:
    g = torch.Generator().manual_seed(1000 * world + layer)
    slots = world * SLOTS_PER_RANK
    w13, w2 = torch.randn(slots, 2 * F, H, generator=g), torch.randn(slots, H, F, generator=g)
    tokens = [padded - 3 * r for r in range(world)]
    return Problem(w13 * 0.3, w2 * 0.3, [torch.randn(t, H, generator=g) for t in tokens],
                   [_distinct_slots(t, slots, g) for t in tokens],
                   [torch.rand(t, K, generator=g) for t in tokens], [t - 2 for t in tokens],
                   padded)


def _expected(p: Problem, rank: int) -> torch.Tensor:
    """The single-process reference over every slot; padding rows get nothing."""
    real = p.real[rank]
    out = torch.zeros_like(p.x[rank])
    out[:real] = fused_experts_reference(p.x[rank][:real], p.w13, p.w2, p.weights[rank][:real],
                                         p.phys[rank][:real])
    return out


# ---- packing, counts, capacity ---------------------------------------------------------------
def test_pack_unpack_round_trip_keeps_large_ids_exact():
    g = torch.Generator().manual_seed(0)
    phys = torch.randint(2 ** 24 - 1000, 2 ** 24, (7, 8), generator=g)
    phys[0] = torch.arange(2 ** 24 - 8, 2 ** 24)  # the largest ids there are
    weights = torch.rand(7, 8, generator=g)
    for num_real in (5, torch.tensor(5)):
        packed = pack_routes(phys, weights, num_real, 12)
        assert packed.shape == (12, 17) and packed.dtype == torch.float32
        ids, w, valid = unpack_routes(packed, 8)
        assert ids.dtype == torch.int64 and valid.dtype == torch.bool
        assert torch.equal(ids[:5], phys[:5]) and torch.equal(w[:5], weights[:5])
        assert valid.tolist() == [True] * 5 + [False] * 7
        assert not packed[5:].any()  # padding and rows past T: all zeros
    with pytest.raises(ValueError):
        pack_routes(phys, weights, 7, 6)


def test_expert_counts_count_valid_rows_only():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10, (50, 3), generator=g)
    valid = torch.rand(50, generator=g) > 0.3
    counts = expert_counts(ids, valid, 10)
    assert torch.equal(counts, torch.bincount(ids[valid].reshape(-1), minlength=10))


def test_capacity_factor_from_the_environment(monkeypatch):
    monkeypatch.delenv(CAPACITY_ENV, raising=False)
    assert capacity_factor() == DEFAULT_CAPACITY_FACTOR
    monkeypatch.setenv(CAPACITY_ENV, "1.5")
    assert capacity_factor() == 1.5
    assert capacity_for(1000, 8, 128) == 94  # ceil(1.5 * 1000 * 8 / 128)
    assert StaticMoEExchange(None, 0, 1, 8).capacity_factor == 1.5
    for bad in ("abc", "0", "-2", "nan", "inf"):
        monkeypatch.setenv(CAPACITY_ENV, bad)
        with pytest.raises(ValueError, match=CAPACITY_ENV):
            capacity_factor()


def test_capacity_sizes():
    assert capacity_for(DECODE_MAX_TOKENS, 8, 128, 2.0) == DECODE_MAX_TOKENS  # decode: all
    assert capacity_for(4096, 8, 128, 2.0) == 512
    assert capacity_for(100, 8, 4, 2.0) == 100  # never above the token count
    assert capacity_for(100, 1, 1000, 0.01) == 1
    with pytest.raises(ValueError):
        capacity_for(100, 8, 128, 0.0)


# ---- the expert computation ------------------------------------------------------------------
@pytest.mark.parametrize("tokens, slots, k, elsewhere", [
    (1, 4, 2, 0), (37, 6, 2, 3), (128, 8, 4, 8), (64, 3, 3, 5)])
def test_grouped_and_dense_equal_the_reference(tokens, slots, k, elsewhere):
    g = torch.Generator().manual_seed(tokens + slots)
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(slots, 2 * F, H, generator=g), torch.randn(slots, H, F, generator=g)
    routes = torch.rand(tokens, slots + elsewhere, generator=g).topk(k, dim=1).indices
    local = torch.where(routes < slots, routes, -1).to(torch.int32)  # -1: served elsewhere
    weights = torch.rand(tokens, k, generator=g)
    ref = fused_experts_reference(x, w13, w2, weights, local)
    most = int(expert_counts(local.long().clamp_min(0), torch.ones(tokens, dtype=torch.bool),
                             slots).max())
    for capacity in (max(1, most), tokens):  # the tightest that fits, and the largest
        got = grouped_experts(x, w13, w2, weights, local, capacity)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_experts(x, w13, w2, weights, local), ref, rtol=1e-5,
                               atol=1e-5)
    ops = StaticCPUOps(None)
    torch.testing.assert_close(ops.fused_experts(x, w13, w2, weights, local), ref,
                               rtol=1e-5, atol=1e-5)


# ---- the exchange, one process ---------------------------------------------------------------
def test_fake_communicator_sees_one_route_gather_per_layer():
    """Two ranks simulated in one: every gather returns this rank's rows twice, the
    reduce-scatter sums both halves, so each output is twice this rank's slots' share."""
    gathers: list[tuple[tuple[int, ...], torch.dtype]] = []

    def gather(out, t, group=None):
        gathers.append((tuple(t.shape), t.dtype))
        out.copy_(torch.cat((t, t)))

    def reduce_scatter(out, partial, group=None):
        out.copy_(partial.view(2, *out.shape).sum(0))

    p = _problem(2, 0)
    for rank in (0, 1):
        gathers.clear()
        exchange = StaticMoEExchange(None, rank, 2, SLOTS_PER_RANK, 2.0, gather, reduce_scatter)
        mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
        compute = _compute(p.w13[mine], p.w2[mine])
        for _ in range(LAYERS):
            out = exchange.run(p.x[0], p.weights[0], p.phys[0], p.padded, compute, p.real[0])
            phys = p.phys[0][:p.real[0]]
            local = torch.where(phys // SLOTS_PER_RANK == rank, phys % SLOTS_PER_RANK, -1)
            ref = fused_experts_reference(p.x[0][:p.real[0]], p.w13[mine], p.w2[mine],
                                          p.weights[0][:p.real[0]], local)
            torch.testing.assert_close(out[:p.real[0]], 2 * ref, rtol=1e-5, atol=1e-5)
        routes = [g for g in gathers if g == ((p.padded, 2 * K + 1), torch.float32)]
        assert len(routes) == LAYERS and len(gathers) == 2 * LAYERS  # tokens + routes


def _compute(w13: torch.Tensor, w2: torch.Tensor, dense: bool = False):
    ops = StaticCPUOps(None)

    def compute(x, weights, slots, capacity=None):
        if dense:
            return dense_experts(x, w13, w2, weights, slots)
        return ops.fused_experts(x, w13, w2, weights, slots, capacity=capacity)
    return compute


def test_one_rank_skips_collectives_and_reruns_overflow_dense():
    def no_collective(*args, **kwargs):
        raise AssertionError("one rank needs no collective")

    p = _problem(1, 0, padded=80)
    exchange = StaticMoEExchange(None, 0, 1, SLOTS_PER_RANK, 2.0, no_collective, no_collective)
    exchange.decode_tokens = 0
    compute = _compute(p.w13, p.w2)
    for factor in (2.0, 0.1):
        exchange.capacity_factor = factor
        out = exchange.run(p.x[0], p.weights[0], p.phys[0], p.padded, compute, p.real[0])
        torch.testing.assert_close(out, _expected(p, 0), rtol=1e-5, atol=1e-5)
    assert (exchange.grouped_runs, exchange.dense_runs) == (1, 1)


# ---- the exchange over gloo ranks ------------------------------------------------------------
# mode -> (capacity factor, decode_tokens, compute always dense)
MODES = {"decode": (2.0, DECODE_MAX_TOKENS, False), "grouped": (2.0, 0, False),
         "dense": (2.0, 0, True), "overflow": (0.1, 0, False)}


def _exchange_rank(rank: int, world: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    from deepinfer.backends.neuron import moe
    from deepinfer.models.moe.exchange import all_gather

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    route_gathers: list[tuple[int, ...]] = []

    def gather(o, t, group=None):
        if t.dtype == torch.float32 and t.shape[1] == 2 * K + 1:
            route_gathers.append(tuple(o.shape))
        all_gather(o, t, group=group)

    moe.all_gather = gather  # every exchange made from here on (this process only) counts
    mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
    result: dict = {}
    with torch.inference_mode():
        for mode, (factor, decode, dense) in MODES.items():
            exchange = StaticMoEExchange(dist.group.WORLD, rank, world, SLOTS_PER_RANK, factor)
            exchange.decode_tokens = decode
            outs = []
            for layer in range(LAYERS):
                p = _problem(world, layer)
                exchange.num_real = p.real[rank]  # the settable attribute, not the argument
                outs.append(exchange.run(p.x[rank], p.weights[rank], p.phys[rank], p.padded,
                                         _compute(p.w13[mine], p.w2[mine], dense)))
            # numpy: torch tensors would cross the queue as shared memory of a dead process
            result[mode] = ([o.numpy() for o in outs], exchange.grouped_runs,
                            exchange.dense_runs)
        result["block"] = _block_through_runtime(rank, world)
    result["route_gathers"] = route_gathers
    dist.destroy_process_group()
    out.put((rank, result))


def _router_problem(world: int) -> tuple[torch.Tensor, list[torch.Tensor], Problem]:
    p = _problem(world, 7)
    gate = torch.randn(world * SLOTS_PER_RANK, H, generator=torch.Generator().manual_seed(7))
    return gate, p.x, p


def _block_through_runtime(rank: int, world: int) -> tuple:
    """An MoEBlock whose ops mix in StaticMoEOps, under expert parallel: the runtime takes the
    ops' exchange. Returns (output, routes counted in the load, exchange is the static one)."""
    import torch.distributed as dist

    from deepinfer.core.accelerator import ParallelContext
    from deepinfer.models.moe.layer import MoEBlock, MoEDims
    from deepinfer.models.moe.runtime import ExpertRuntime

    gate, xs, p = _router_problem(world)
    dims = MoEDims(H, F, RouterSpec(world * SLOTS_PER_RANK, K))
    runtime = ExpertRuntime(1, dims.router.num_experts,
                            ParallelContext(rank, world, dist.group.WORLD, True))
    block = MoEBlock(dims, 0, StaticCPUOps(None), runtime)
    mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
    block.gate.data, block.w13.data, block.w2.data = gate, p.w13[mine], p.w2[mine]
    runtime.begin_step(xs[rank].shape[0], p.real[rank])
    out = block(xs[rank])
    return out.numpy(), int(runtime.load.sum()), runtime.exchange is runtime.static_exchange


def _run_ranks(world: int) -> list[dict]:
    port = free_port()
    return spawn_ranks(_exchange_rank, [(r, world, port) for r in range(world)], TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_one_process(world):
    results = _run_ranks(world)
    problems = [_problem(world, layer) for layer in range(LAYERS)]
    expected_runs = {"decode": (LAYERS, 0), "grouped": (LAYERS, 0), "dense": (LAYERS, 0),
                     "overflow": (0, LAYERS)}  # "dense" computes dense inside the grouped branch
    for rank, result in enumerate(results):
        for mode, (outs, grouped, dense) in ((m, result[m]) for m in MODES):
            assert (grouped, dense) == expected_runs[mode], mode
            for p, got in zip(problems, outs):
                torch.testing.assert_close(torch.from_numpy(got), _expected(p, rank),
                                           rtol=1e-5, atol=1e-5)
        padded = problems[0].padded
        assert result["route_gathers"] == [(world * padded, 2 * K + 1)] * (len(MODES) * LAYERS
                                                                           + 1)
        gate, xs, p = _router_problem(world)
        out, counted, static = result["block"]
        weights, ids = select_experts(xs[rank] @ gate.T, RouterSpec(world * SLOTS_PER_RANK, K))
        p = Problem(p.w13, p.w2, [xs[rank]], [ids.long()], [weights], [p.real[rank]], p.padded)
        torch.testing.assert_close(torch.from_numpy(out), _expected(p, 0), rtol=1e-5,
                                   atol=1e-5)
        assert static and counted == p.real[0] * K


# ---- a whole model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    # Three layers: layer 0 dense, two MoE layers.
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe",
                           num_hidden_layers=3)


def _accelerator(path: str, static: bool) -> CPUAccelerator:
    acc = CPUAccelerator()
    if static:
        acc.runner = TorchRunner("cpu", acc.capabilities, StaticCPUOps)
    acc.init_device()
    acc.load_model(ModelSpec(path, dtype="float32"))
    return acc


def _prefill_logits(acc: CPUAccelerator, prompt: list[int], block_size: int = 16
                    ) -> torch.Tensor:
    pages = -(-len(prompt) // block_size)
    acc.allocate_kv_cache(pages + 1, block_size)
    n = len(prompt)
    slots = [(p // block_size) * block_size + p % block_size for p in range(n)]
    batch = ModelBatch(prompt, list(range(n)), [n], [n], (GroupBatch([list(range(pages))],
                                                                     slots),), [0], [])
    return acc.forward_logits(batch, all_tokens=True)


@pytest.mark.parametrize("factor, decode_tokens, runs", [
    (2.0, DECODE_MAX_TOKENS, (2, 0)),  # 45 tokens: capacity 45, grouped
    (0.05, 0, (0, 2))])  # capacity 1: both MoE layers overflow and rerun dense
def test_static_moe_ops_model_equals_cpu_ops(qwen3_moe, factor, decode_tokens, runs):
    prompt = torch.randint(2, 250, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _prefill_logits(_accelerator(qwen3_moe, False), prompt)
    acc = _accelerator(qwen3_moe, True)
    runtime = acc.runner.moe
    exchange = runtime.static_exchange
    assert runtime.exchange is None and not acc.runner.model.needs_collectives  # one rank
    exchange.capacity_factor, exchange.decode_tokens = factor, decode_tokens
    got = _prefill_logits(acc, prompt)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (exchange.grouped_runs, exchange.dense_runs) == runs


def test_static_moe_ops_greedy_generation_equals_cpu_ops(qwen3_moe):
    prompts = [torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for static in (False, True):
        config = EngineConfig(ModelSpec(qwen3_moe, dtype="float32"),
                              CacheConfig(block_size=16, num_blocks=32), SchedulerConfig(),
                              seed=0)
        acc = CPUAccelerator()
        if static:
            acc.runner = TorchRunner("cpu", acc.capabilities, StaticCPUOps)
        engine = Engine(config, acc, load_tokenizer=False)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy)
        got: dict[str, list[int]] = {"r0": [], "r1": []}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        tokens.append(got)
    assert tokens[0] == tokens[1]
    assert acc.runner.moe.static_exchange.grouped_runs > 0
