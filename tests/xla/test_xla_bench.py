"""examples/neuron/bench_neuron.py on the Neuron backend's xla device: the TTFT/TPOT matrix, and
per bucket built at start-up the graph neuronx-cc would receive (HLO instructions) and what it
cost to compile. Runs in the XLA venv (scripts/xla_env.sh)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch_xla")

from tests.test_bench_neuron import MATRIX, check_matrix, load_example  # noqa: E402

# Few buckets: tokens 16, 32; batches 1, 2; context 1, 2 blocks of 16.
ENGINE = ["-o", "num_blocks=16", "-o", "block_size=16", "-o", "max_num_batched_tokens=32",
          "-o", "max_num_seqs=2", "-o", "max_model_len=32"]


def test_matrix_and_a_report_of_every_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_DEVICE", "xla")
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "1")
    bench = load_example("bench_neuron")
    model = bench.write_tiny_checkpoint(str(tmp_path / "tiny"))
    out = str(tmp_path / "bench.json")
    assert bench.main(["--accelerator", "neuron", "--model", model, "--repeats", "1",
                       "--out", out, *MATRIX, *ENGINE]) == 0
    with open(out) as f:
        result = json.load(f)
    check_matrix(result, ("ttft_ms", "tpot_ms", "throughput_tok_s"))
    graphs = result["graphs"]
    assert {(g["kind"], g["size"], g["context_blocks"]) for g in graphs} == {
        (kind, size, width) for kind, sizes in (("decode", (1, 2)), ("prefill", (16, 32)))
        for size in sizes for width in (1, 2)}
    assert all(g["compiles"] == 1 and g["compile_s"] > 0 and g["hlo_instructions"] > 100
               for g in graphs)
