"""What every torch-based backend shares: the model runner, the paged KV pool, launched steps,
speculative decoding, and the reference ops and attention in plain torch that a backend
replaces piece by piece with its kernels."""
