"""Conformance suites for backend authors: `conformance` (the Accelerator API on a tiny
checkpoint against transformers) and `hicache` (the host tier end to end through an Engine)."""
from deepinfer.testing.conformance import (AcceleratorConformance, ConformanceSuite,
                                           run_conformance)

__all__ = ["AcceleratorConformance", "ConformanceSuite", "run_conformance"]
