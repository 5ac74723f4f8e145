"""Run DeepInfer's backend conformance suite on this plugin's accelerator."""
from deepinfer.core.plugins import load_plugins, select_accelerator
from deepinfer.testing.conformance import AcceleratorConformance, Chunk, run_step
from deepinfer_example_plugin.accelerator import CountingAccelerator


class TestCountingConformance(AcceleratorConformance):
    accelerator_cls = CountingAccelerator

    def test_counts_executed_steps(self):
        # The suite's helpers also serve a backend's own tests: a loaded accelerator, a pool of
        # shuffled block ids, and batches built the way the scheduler builds them.
        with self.suite.loaded() as (accelerator, pool):
            seq = self.suite.new_seq(pool, "A")
            run_step(accelerator, [Chunk(seq, num_tokens=len(seq.prompt))])
            run_step(accelerator, [Chunk(seq)])
        assert (accelerator.steps, accelerator.tokens) == (2, len(seq.prompt) + 1)


def test_entry_point_registers_the_backend():
    assert select_accelerator(load_plugins(), "example") is CountingAccelerator
