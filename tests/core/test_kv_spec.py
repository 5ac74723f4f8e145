"""The KV spec: groups of equal layers, page layout (chunks) and bytes, compressed entries."""
import pytest

from deepinfer.core.kv.spec import CacheEntry, KVSpec, LayerKV, kv_heads_layer, latent_layer


def test_equal_layers_form_groups_in_order_and_empty_layers_none():
    full, windowed = kv_heads_layer(2, 8), kv_heads_layer(2, 8, sliding_window=32)
    spec = KVSpec((full, windowed, LayerKV(()), full, windowed))
    assert [(g.layers, g.sliding_window) for g in spec.groups] == [((0, 3), None),
                                                                    ((1, 4), 32)]
    assert spec.group_of(3) == 0 and spec.group_of(4) == 1 and spec.has_sliding_window
    # A page is one block of every group: chunks group by group, layer by layer, K then V.
    assert [(c.group, c.layer, c.entry.name) for c in spec.chunks(4)] == [
        (0, 0, "k"), (0, 0, "v"), (0, 3, "k"), (0, 3, "v"),
        (1, 1, "k"), (1, 1, "v"), (1, 4, "k"), (1, 4, "v")]
    assert spec.block_bytes(4, 2) == 8 * 4 * 2 * 8 * 2


def test_latent_and_compressed_entries_size_pages():
    assert KVSpec.uniform(3, latent_layer(576)).block_bytes(64, 2) == 3 * 64 * 576 * 2
    compressed = LayerKV((CacheEntry("c", (512,), rate=4), CacheEntry("idx", (64,), rate=4)))
    spec = KVSpec((compressed, latent_layer(8)), state_bytes=1024)
    assert [c.numel for c in spec.chunks(128)] == [32 * 512, 32 * 64, 128 * 8]
    with pytest.raises(ValueError, match="compression rate"):
        spec.chunks(6)
    with pytest.raises(ValueError, match="sliding_window"):
        LayerKV((), sliding_window=0)


def test_block_multiple_refuses_other_block_sizes():
    spec = KVSpec((latent_layer(8),), block_multiple=128)
    assert len(spec.chunks(256)) == 1
    with pytest.raises(ValueError, match="multiple of 128"):
        spec.chunks(64)
