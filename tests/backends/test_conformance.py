"""The CPU backend passes the conformance suite that plugin authors run on theirs, and the suite
rejects a backend that gets paged KV wrong."""
import dataclasses

import pytest

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import GroupBatch, ModelBatch, SamplerOutput
from deepinfer.testing.conformance import AcceleratorConformance, run_conformance


class TestCPUConformance(AcceleratorConformance):
    accelerator_cls = CPUAccelerator


class MisplacedKV(CPUAccelerator):
    """Writes each token's KV one block past its slot, so reads through the block table miss it."""

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        shifted = [slot + batch.block_size for slot in batch.slot_mapping]
        groups = (GroupBatch(batch.block_tables, shifted),)
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


@pytest.mark.parametrize("broken, check", [(MisplacedKV, "batched greedy decode"),
                                           (SamplesEverySequence, "chunked prefill"),
                                           (LoadsOnePageShort, "host page copy")])
def test_suite_rejects_broken_backend(tmp_path, broken, check):
    with pytest.raises(AssertionError, match=check):
        run_conformance(broken, str(tmp_path))
