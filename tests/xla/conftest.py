"""The XLA tests' device: PyTorch/XLA's CPU PJRT device, set before torch_xla is imported (the
servers these tests start inherit it). Its LLVM back end compiles unoptimised: the graphs,
their count and their results are the same, the compiles take half the time."""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
