"""Backend-neutral core: imports nothing from deepinfer.backends or deepinfer.serve."""
