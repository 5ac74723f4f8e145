"""The CPU backend: the torch reference ops (backends/torch) with C++ kernels for GGUF weights
and fused float32 decode ops."""
