"""The CPU backend passes the conformance suite that plugin authors run on theirs (all three KV
shapes), and the suite rejects a backend that gets paged KV wrong, one that reads keys outside a
sliding window, and names the shape a backend cannot run."""
import dataclasses

import pytest

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.backends.torch.ops import ReferenceOps
from deepinfer.backends.torch.runner import TorchRunner
from deepinfer.core.batch import GroupBatch, ModelBatch, SamplerOutput
from deepinfer.core.kv.manager import KVCacheManager
from deepinfer.core.kv.spec import KVSpec, kv_heads_layer
from deepinfer.core.request import Request
from deepinfer.core.sampling import SamplingParams
from deepinfer.testing.conformance import (
    BLOCK_SIZE,
    KV_SHAPES,
    WINDOW,
    AcceleratorConformance,
    Chunk,
    ConformanceSuite,
    Seq,
    build_batch,
    run_conformance,
)


class TestCPUConformance(AcceleratorConformance):
    accelerator_cls = CPUAccelerator


class MisplacedKV(CPUAccelerator):
    """Writes each token's KV one block past its slot, so reads through the block table miss it."""

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        groups = tuple(GroupBatch(g.block_tables,
                                  [s + self.runner.cache.block_size for s in g.slot_mapping])
                       for g in batch.groups)
        return super().execute(dataclasses.replace(batch, groups=groups))


class SamplesEverySequence(CPUAccelerator):
    """Ignores sample_indices: partial prefill chunks get a token too."""

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        out = super().execute(batch)
        extra = batch.num_seqs - len(out.token_ids)
        return SamplerOutput(out.token_ids + [0] * extra, out.logprobs + [None] * extra)


class LoadsOnePageShort(CPUAccelerator):
    """An off-by-one: the last host page of a load never reaches its device block."""

    def copy_pages(self, host_pages, device_blocks, to_device):
        if to_device:
            host_pages, device_blocks = host_pages[:-1], [b[:-1] for b in device_blocks]
        return super().copy_pages(host_pages, device_blocks, to_device)


class IgnoresSlidingWindow(CPUAccelerator):
    """Reports the model's KV spec, window included (so the engine frees the blocks that fall
    out of the window and its tables hold the null block there), but its attention runs on a
    copy of the spec without windows: every key from position 0 is read through the table."""

    def load_model(self, spec):
        info = super().load_model(spec)
        self.runner.cache.spec = KVSpec(
            tuple(dataclasses.replace(layer, sliding_window=None) for layer in
                  info.kv_spec.layers), info.kv_spec.state_bytes)
        return info


class NoMLA(CPUAccelerator):
    """A backend whose ops have no MLA attention (like a third-party backend before it adds
    one): the reference ops without ReferenceMLAOps."""

    def __init__(self) -> None:
        super().__init__()
        self.runner = TorchRunner("cpu", self.capabilities, ReferenceOps, backend=self.name)


@pytest.mark.parametrize("broken, check", [(MisplacedKV, "kv: batched greedy decode"),
                                           (SamplesEverySequence, "kv: chunked prefill"),
                                           (LoadsOnePageShort, "kv: host page copy"),
                                           (IgnoresSlidingWindow, "window: batched greedy decode")])
def test_suite_rejects_broken_backend(tmp_path, broken, check):
    with pytest.raises(AssertionError, match=check):
        run_conformance(broken, str(tmp_path))


def test_a_missing_shape_is_named_with_the_way_to_opt_out(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_conformance(NoMLA, str(tmp_path))
    message = str(failure.value)
    assert message.startswith("NoMLA failed [latent: batched greedy decode] (dense DeepSeek-V3")
    assert ("ValueError: DeepseekV3ForCausalLM needs MLAOps, which backend 'cpu' does not "
            "provide") in message
    assert "kv_shapes = ('kv', 'window')" in message


def test_an_opted_out_shape_is_not_run(tmp_path):
    names = [name for name, _ in ConformanceSuite(NoMLA, str(tmp_path), ("kv", "window")).checks()]
    assert not any(name.startswith("latent") for name in names)
    assert len(names) == 1 + 2 * len(ConformanceSuite.CHECKS)
    with pytest.raises(ValueError, match="unknown KV shapes"):
        ConformanceSuite(NoMLA, str(tmp_path), ("mla",))
    assert KV_SHAPES == ("kv", "latent", "window")


@pytest.mark.parametrize("steps", [[10] + [1] * 8, [3, 3, 4] + [1] * 8])
def test_window_tables_hold_the_null_block_where_the_engine_freed_blocks(steps):
    """The suite's windowed block tables against the engine's KV manager, step by step
    (one prefill or three chunks, then decodes): the same pages read as the null block."""
    spec = KVSpec.uniform(2, kv_heads_layer(2, 16, WINDOW))
    manager = KVCacheManager(64, BLOCK_SIZE, enable_caching=False, spec=spec)
    prompt = list(range(3, 13))
    req = Request("r", list(prompt), SamplingParams(), seed=0, max_tokens=8)
    seq = Seq("r", list(prompt), list(range(1, 7)), windows=(WINDOW,))
    nulls_seen = 0
    for n in steps:
        manager.free_out_of_window(req)  # what the scheduler does before placing a request
        assert manager.allocate(req, n)
        engine = [block == 0 for block in manager.block_ids("r")]
        (group,) = build_batch([Chunk(seq, n, sample=False)]).groups
        ours = [block == 0 for block in group.block_tables[0]]
        assert ours == engine, f"after {seq.computed} computed tokens"
        nulls_seen = max(nulls_seen, sum(ours))
        req.num_computed_tokens = seq.computed = seq.computed + n
        if seq.computed >= len(prompt):
            req.output_token_ids.append(5)
            seq.outputs.append(5)
    assert nulls_seen == 3  # the last decode, at position 17, sees 12..17: pages 0-2 freed
