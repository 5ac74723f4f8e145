"""benchmarks/cuda/profile_run: how a run's steps and kernels are grouped."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cuda"))
from profile_run import HostLog, StepRecord, kind_of, phase_report  # noqa: E402


def test_steps_grouped_by_what_they_scheduled() -> None:
    log = HostLog([StepRecord(8192, 0, 0.050, 0.0), StepRecord(8000, 192, 0.200, 0.150),
                   StepRecord(0, 256, 0.012, 0.004), StepRecord(0, 250, 0.013, 0.005)])
    phases = phase_report(log)
    assert set(phases) == {"prefill", "mixed", "decode"}
    assert phases["mixed"] == pytest.approx({"steps": 1, "prompt_tokens": 8000, "decodes": 192,
                                             "call_s": 0.2, "wait_s": 0.15, "host_s": 0.05})
    assert phases["decode"]["steps"] == 2 and phases["decode"]["decodes"] == 506
    assert phases["decode"]["host_s"] == pytest.approx(0.016)


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"), ("_gemv_kernel", "gemm"),
    ("_rotary_decode_kernel", "decode_attention"), ("_decode_split_kernel", "decode_attention"),
    ("_prefill_kernel", "prefill_attention"), ("_rms_norm_kernel", "norm"),
    ("_rotary_kernel", "rotary_kv"), ("_silu_and_mul_kernel", "activation"),
    ("Memset (Device)", "other")])
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kind_of(name) == kind
