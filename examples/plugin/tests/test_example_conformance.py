"""Run DeepInfer's backend conformance suite on this plugin's accelerator: every check on each
KV shape (llama K/V, DeepSeek-V3 MLA latent, Mistral sliding window)."""
from deepinfer_example_plugin.accelerator import CountingAccelerator

from deepinfer.core.accelerator import Accelerator
from deepinfer.core.plugins import load_plugins, select_accelerator
from deepinfer.testing.conformance import AcceleratorConformance, Chunk, run_step


class TestCountingConformance(AcceleratorConformance):
    accelerator_cls = CountingAccelerator
    # Every shape; a backend without one (say, no MLA kernel yet) would list only the others:
    # kv_shapes = ("kv", "window")

    def test_counts_executed_steps(self):
        # The suite's helpers also serve a backend's own tests: a loaded accelerator, a pool of
        # shuffled block ids, and batches built the way the scheduler builds them.
        with self.suite.loaded("kv") as (accelerator, pool):
            seq = self.suite.new_seq(pool, "A")
            run_step(accelerator, [Chunk(seq, num_tokens=len(seq.prompt))])
            run_step(accelerator, [Chunk(seq)])
        assert (accelerator.steps, accelerator.tokens) == (2, len(seq.prompt) + 1)


def test_entry_point_registers_the_backend():
    backend = select_accelerator(load_plugins(), "example")
    assert backend is CountingAccelerator and issubclass(backend, Accelerator)
