"""Quantized weights: checkpoint tensors that stay packed (GGUF blocks, DeepSeek's FP8 with
block scales), the modules that hold them in a model, and the plan of which weights a backend
keeps packed. A packed linear weight reaches the backend through ModelOps.linear, which routes
it to ModelOps.packed_linear."""
