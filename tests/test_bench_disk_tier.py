"""benchmarks/disk_tier.py end to end at a tiny size: every page read back whole through the
disk tier for each reader count, the plain-read bound beside it, JSON and PNG written."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import disk_tier  # noqa: E402


def test_disk_tier_bench_writes_its_results(tmp_path):
    out = tmp_path / "out"
    assert disk_tier.main(["--dir", str(tmp_path), "--pages", "6", "--page-mb", "0.25",
                           "--readers", "1,3", "--out", str(out)]) == 0
    result = json.loads((out / "disk_tier.json").read_text())
    assert set(result["tier_bytes_per_s"]) == set(result["raw_bytes_per_s"]) == {"1", "3"}
    assert all(v > 0 for v in result["tier_bytes_per_s"].values())
    assert (out / "disk_tier.png").stat().st_size > 0
    assert not os.path.exists(result["dir"]), "the scratch folder was left behind"
