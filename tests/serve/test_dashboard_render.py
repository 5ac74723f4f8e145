"""scripts/render_dashboard.py against the shared tiny server: Debian's prometheus scrapes it
under traffic, every panel of the Grafana dashboard is evaluated and drawn, and headless
chromium screenshots the page. Skipped where either tool is missing."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "render_dashboard.py"
DASHBOARD = SCRIPT.parents[1] / "examples" / "grafana" / "deepinfer.json"
MISSING = [tool for tool in ("prometheus", "chromium") if shutil.which(tool) is None]


@pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not on PATH (Debian: "
                    "apt-get install prometheus chromium)")
def test_every_panel_renders_with_data(tiny_server, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--url", tiny_server.url, "--out",
                           str(tmp_path), "--seconds", "8", "--concurrency", "3"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    panels = json.loads((tmp_path / "panels.json").read_text())
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert list(panels) == titles
    assert {t: s for t, s in panels.items() if not (s["series"] and s["points"])} == {}
    png = (tmp_path / "dashboard.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    tiny_server.wait_idle()  # the traffic is over, nothing left running
