"""The one-kernel decode attention (rotary_decode.py) against the two kernels it replaces:
rotary_store_kv_ (rotary, Qwen3's q/k norm, the KV write) then paged_decode_attention (split-K
and merge). Both run under the interpreter on CPU, or on the GPU when there is one."""
from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda.kernels.decode_attention import paged_decode_attention
from deepinfer.backends.cuda.kernels.rotary import rotary_store_kv_
from deepinfer.backends.cuda.kernels.rotary_decode import SplitCounters, rotary_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HK, D, BLOCK = 8, 2, 32, 16
SEQ_LENS = [1, 17, 32, 100, 130, 1]  # the last row pads a graph batch: slot -1, null block

pytestmark = pytest.mark.usefixtures("gpu_bf16_rounding")


class NoCounters(SplitCounters):
    """As during a graph capture that finds the counters too small: the merge runs apart."""

    def get(self, n: int, device: torch.device) -> None:
        return None


def _tables(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables [B, W] over shuffled blocks (block 0 is the null block) and each row's
    new-token slot (-1 for the padding row)."""
    width = max(-(-n // BLOCK) for n in SEQ_LENS)
    order = (torch.randperm(len(SEQ_LENS) * width, generator=gen) + 1).view(len(SEQ_LENS), width)
    order[-1] = 0
    last = torch.tensor(SEQ_LENS) - 1
    slots = order[torch.arange(len(SEQ_LENS)), last // BLOCK] * BLOCK + last % BLOCK
    slots[-1] = -1
    return order.to(torch.int32), slots, 1 + order.numel()


def _case(dtype: torch.dtype, norm: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tables, slots, blocks = _tables(gen)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    caches = [rnd(blocks * BLOCK, HK, D) for _ in "kv"]
    qkv = rnd(len(SEQ_LENS), (HQ + 2 * HK) * D) * (3.0 if norm else 1.0)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    freqs = torch.outer(torch.arange(256.0), inv).repeat(1, 2)
    weights = (tuple((1 + 0.5 * rnd(D).float()).to(dtype) for _ in "qk") + (1e-6,)
               if norm else None)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return dict(qkv=to(qkv), caches=[to(c) for c in caches], cos=to(freqs.cos()),
                sin=to(freqs.sin()), tables=to(tables), slots=to(slots),
                seq_lens=to(torch.tensor(SEQ_LENS, dtype=torch.int32)),
                positions=to(torch.tensor(SEQ_LENS) - 1),
                qk_norm=None if weights is None else tuple(
                    w.to(DEVICE) if torch.is_tensor(w) else w for w in weights))


def _split(qkv: torch.Tensor):
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    b = qkv.shape[0]
    return q.view(b, HQ, D), k.view(b, HK, D), v.view(b, HK, D)


def _unfused(c: dict, splits: int, window: int):
    qkv, caches = c["qkv"].clone(), [x.clone() for x in c["caches"]]
    q, k, v = _split(qkv)
    rotary_store_kv_(q, k, v, c["positions"], c["cos"], c["sin"], *caches, c["slots"],
                     c["qk_norm"])
    out = paged_decode_attention(q, *caches, c["tables"], c["seq_lens"], BLOCK, D ** -0.5,
                                 splits, window=window)
    return out, caches


def _fused(c: dict, splits: int, window: int, counters: SplitCounters):
    qkv, caches = c["qkv"].clone(), [x.clone() for x in c["caches"]]
    q, k, v = _split(qkv)
    out = rotary_decode_attention(q, k, v, c["positions"], c["cos"], c["sin"], *caches,
                                  c["slots"], c["tables"], c["seq_lens"], BLOCK, D ** -0.5,
                                  splits, counters, window=window, qk_norm=c["qk_norm"])
    assert torch.equal(qkv, c["qkv"])  # q, k and v are read, never written
    return out, caches


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,window,norm", [(1, 0, False), (4, 0, False), (2, 0, True),
                                                (4, 40, True), (8, 0, False)])
def test_one_kernel_equals_rotary_then_attention(dtype, splits, window, norm):
    c = _case(dtype, norm, seed=splits * 100 + window + norm)
    counters = SplitCounters()
    ref, ref_caches = _unfused(c, splits, window)
    for _ in range(2):  # twice: the tickets are back to 0 after a launch
        out, caches = _fused(c, splits, window, counters)
        for got, want in zip(caches, ref_caches):
            _assert_close(got, want, dtype)  # same slots written, nothing else touched
        _assert_close(out, ref, dtype)
        if splits > 1:
            assert int(counters.get(1, torch.device(DEVICE)).abs().sum()) == 0


def test_merge_apart_when_no_counters():
    c = _case(torch.float32, True, seed=3)
    ref, _ = _unfused(c, 4, 0)
    out, _ = _fused(c, 4, 0, NoCounters())
    _assert_close(out, ref, torch.float32)


def test_rejects_partial_rotation():
    c = _case(torch.float32, False, seed=4)
    q, k, v = _split(c["qkv"])
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_decode_attention(q, k, v, c["positions"], c["cos"][:, : D // 2],
                                c["sin"][:, : D // 2], *c["caches"], c["slots"], c["tables"],
                                c["seq_lens"], BLOCK, 1.0, 2, SplitCounters())
