"""The AWS Trainium (Neuron) backend: static shapes, a fixed KV pool, static MoE; its graphs run
on the host too (DEEPINFER_NEURON_DEVICE=cpu)."""
