"""NVIDIA GPU backend: Triton kernels, CUDA graphs for decode, UVA page copy for HiCache."""
