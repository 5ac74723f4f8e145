"""The backend itself: a plain Accelerator subclass. This one reuses the CPU backend and counts
the steps and tokens it executes; a real backend implements the same methods for its device."""
from __future__ import annotations

from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.batch import ModelBatch, SamplerOutput


class CountingAccelerator(CPUAccelerator):
    name = "example"

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.tokens = 0

    def execute(self, batch: ModelBatch) -> SamplerOutput:
        self.steps += 1
        self.tokens += batch.num_tokens
        return super().execute(batch)
