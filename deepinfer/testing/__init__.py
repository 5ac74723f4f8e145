"""Conformance suites for backend authors: `conformance` (the Accelerator API on tiny
checkpoints of each KV shape, against transformers) and `hicache` (the host tier end to end
through an Engine)."""
from deepinfer.testing.conformance import (
                                           KV_SHAPES,
                                           AcceleratorConformance,
                                           ConformanceSuite,
                                           run_conformance,
)

__all__ = ["KV_SHAPES", "AcceleratorConformance", "ConformanceSuite", "run_conformance"]
