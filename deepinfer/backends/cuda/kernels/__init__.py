"""Triton kernels of the CUDA backend. Each module holds one kernel family and its launcher.

Layout shared by every kernel: one layer's cache is two tensors k_cache, v_cache of shape
[num_slots, kv_heads, head_dim] (num_slots = num_blocks * block_size, a token's slot is
block_id * block_size + offset), views of one [num_layers, 2, num_slots, kv_heads, head_dim]
device tensor. Block tables are int32 [num_seqs, max_blocks]; block 0 is the null block that
padding points at.

- norm.py: rms_norm(x, weight, eps), add_rms_norm(x, residual, weight, eps)
- rotary.py: apply_rotary_(q, k, positions, cos, sin) in place; rotary_store_kv_(...) rotates
  q in place and k straight into its cache slot, with v (the path every step takes)
- activation.py: silu_and_mul(x)
- kv_write.py: store_kv(k, v, k_cache, v_cache, slot_mapping)
- decode_attention.py: paged_decode_attention(...) (GQA, split-K, fixed grid for CUDA graphs)
- prefill_attention.py: paged_prefill_attention(...) (varlen, causal over a cached prefix)
- gemv.py: gemv(x, weight, bias) for one-token projections, tiles per shape (config_for)
- pdl.py: programmatic dependent launch for the decode-path kernels (Hopper and later)

All run under TRITON_INTERPRET=1 on CPU tensors too (PDL off), which is how CI tests them.
"""
