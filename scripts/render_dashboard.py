#!/usr/bin/env python3
"""Render the Grafana dashboard (examples/grafana/deepinfer.json) from a live DeepInfer server,
without Grafana: Debian's `prometheus` scrapes the server while this script sends it traffic,
then every panel's queries are evaluated through Prometheus' HTTP API (query_range over the
traffic), drawn as SVG line charts into one HTML page, and screenshotted by headless
`chromium`.

    python scripts/render_dashboard.py --url http://127.0.0.1:8000 --out /tmp/dash

writes /tmp/dash/dashboard.html, dashboard.png and panels.json ({panel title: {"series": n,
"points": finite points}}), and exits 1 if a panel got no data. Needs `prometheus` and
`chromium` on PATH (Debian: apt-get install prometheus chromium); the server must serve
/metrics without a key (--metrics-public where it has --api-key).
"""
from __future__ import annotations

import argparse
import html
import json
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "deepinfer.json"
COLORS = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9")
PANEL_W, PANEL_H = 560, 250  # one panel's plot area in the page, pixels
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 300.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


# ---- Prometheus ------------------------------------------------------------------------------
def start_prometheus(target: str, workdir: Path, interval_s: int) -> tuple[subprocess.Popen, str]:
    """Prometheus scraping `target` (host:port) every `interval_s`; its API's base URL."""
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {interval_s}s\n"
                      f"  evaluation_interval: {interval_s}s\n"
                      "scrape_configs:\n  - job_name: deepinfer\n"
                      f"    metrics_path: /metrics\n    static_configs:\n"
                      f"      - targets: ['{target}']\n")
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}",
                             f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()}")
        try:
            urllib.request.urlopen(f"{base}/-/ready", timeout=2).close()
            return proc, base
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("prometheus not ready after 60 s")


def wait_scraped(prom: str, query: str, at_least: float, timeout: float) -> None:
    """Until Prometheus' latest scrape shows `query` >= at_least (the traffic is all in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": query}))
        values = [float(r["value"][1]) for r in result["data"]["result"]]
        if values and sum(values) >= at_least:
            return
        time.sleep(0.5)
    raise RuntimeError(f"prometheus never saw {query} >= {at_least}")


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}s"}
    reply = get_json(f"{prom}/api/v1/query_range?" + urllib.parse.urlencode(params))
    if reply.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {reply}")
    return reply["data"]["result"]


# ---- traffic ---------------------------------------------------------------------------------
def model_name(url: str) -> str:
    return get_json(f"{url}/v1/models")["data"][0]["id"]


def finished_requests(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def send_traffic(url: str, model: str, seconds: float, concurrency: int) -> int:
    """Chat and completion requests from `concurrency` threads for `seconds`: shared system
    prompts (prefix-cache hits), n of 1 or 2, a spread of max_tokens. Returns how many
    generations finished."""
    systems = [f"You are assistant number {k}. " + "Answer briefly and politely. " * 6
               for k in range(3)]
    done, lock, end = [0], threading.Lock(), time.monotonic() + seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            n, max_tokens = rng.choice((1, 1, 2)), rng.choice((4, 8, 16, 24))
            question = f"Question {rng.randrange(10**6)}: what comes after {rng.randrange(99)}?"
            if rng.random() < 0.5:
                body = {"model": model, "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                        "messages": [{"role": "system", "content": rng.choice(systems)},
                                     {"role": "user", "content": question}]}
                post_json(f"{url}/v1/chat/completions", body)
            else:
                body = {"model": model, "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                        "prompt": rng.choice(systems) + question}
                post_json(f"{url}/v1/completions", body)
            with lock:
                done[0] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]


# ---- panels ----------------------------------------------------------------------------------
def expand(expr: str, rate_window: str) -> str:
    """Grafana's variables as this run sets them: every model, a rate window of a few
    scrapes."""
    return expr.replace("$__rate_interval", rate_window).replace("$model_name", ".*")


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def evaluate(dashboard: dict, prom: str, start: float, end: float, step: float,
             rate_window: str) -> list[dict]:
    """Every panel with its plotted series: [{"title", "unit", "series": [(name, [(t, v)])]}]."""
    panels = []
    for panel in dashboard["panels"]:
        series = []
        for target in panel["targets"]:
            for result in query_range(prom, expand(target["expr"], rate_window), start, end,
                                      step):
                points = [(float(t), float(v)) for t, v in result["values"]]
                series.append((legend(target.get("legendFormat", ""), result["metric"]),
                               points))
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        panels.append({"title": panel["title"], "description": panel.get("description", ""),
                       "unit": unit, "series": series})
    return panels


def finite_points(panel: dict) -> int:
    return sum(1 for _, points in panel["series"] for _, v in points if math.isfinite(v))


def fmt_value(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    return f"{value:.3g}"


def svg_panel(panel: dict, start: float, end: float) -> str:
    """One panel: its lines over [start, end], the y range written at the axis."""
    values = [v for _, points in panel["series"] for _, v in points if math.isfinite(v)]
    low, high = (min(0.0, min(values)), max(values)) if values else (0.0, 1.0)
    high = high if high > low else low + 1.0
    pad_l, pad_t, pad_b = 70, 8, 22
    w, h = PANEL_W - pad_l, PANEL_H - pad_t - pad_b

    def xy(t: float, v: float) -> str:
        x = pad_l + (t - start) / (end - start) * w
        return f"{x:.1f},{pad_t + (high - v) / (high - low) * h:.1f}"

    parts = [f'<svg width="{PANEL_W}" height="{PANEL_H}">',
             f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="#181b1f" '
             'stroke="#2c3235"/>']
    for k in range(5):
        y, v = pad_t + h * k / 4, high - (high - low) * k / 4
        parts.append(f'<line x1="{pad_l}" x2="{PANEL_W}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#2c3235"/>')
        parts.append(f'<text x="{pad_l - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{html.escape(fmt_value(v, panel["unit"]))}</text>')
    parts.append(f'<text x="{pad_l}" y="{PANEL_H - 4}">-{end - start:.0f} s</text>'
                  f'<text x="{PANEL_W}" y="{PANEL_H - 4}" text-anchor="end">now</text>')
    count = len(panel["series"])
    for i, (_, points) in enumerate(panel["series"]):
        width = 1.5 + 1.5 * (count - 1 - i)  # earlier lines wider: equal series stay visible
        runs, run = [], []  # a NaN (no requests in the window) breaks the line
        for t, v in points:
            if math.isfinite(v):
                run.append(xy(t, v))
            elif run:
                runs, run = runs + [run], []
        for r in runs + [run]:
            if len(r) == 1:
                x, y = r[0].split(",")
                parts.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{COLORS[i % 7]}"/>')
            elif r:
                parts.append(f'<polyline fill="none" stroke="{COLORS[i % 7]}" '
                             f'stroke-width="{width}" points="{" ".join(r)}"/>')
    parts.append("</svg>")
    return "".join(parts)


def page(dashboard: dict, panels: list[dict], start: float, end: float) -> str:
    cells = []
    for panel in panels:
        items = "".join(f'<span><i style="background:{COLORS[i % 7]}"></i>'
                        f"{html.escape(name)}</span>"
                        for i, (name, _) in enumerate(panel["series"]))
        cells.append(f'<div class="panel"><h2>{html.escape(panel["title"])}</h2>'
                     f'<p>{html.escape(panel["description"])}</p>'
                     f'{svg_panel(panel, start, end)}<div class="legend">{items}</div></div>')
    style = ("body{background:#111217;color:#ccccdc;font:13px sans-serif;margin:12px}"
             "h1{font-size:18px;margin:4px 0 10px}"
             ".grid{display:grid;grid-template-columns:repeat(2,600px);gap:10px}"
             ".panel{background:#181b1f;border:1px solid #2c3235;padding:8px}"
             "h2{font-size:14px;margin:0}p{margin:2px 0 6px;color:#8e8e9a;font-size:11px}"
             "svg text{fill:#8e8e9a;font-size:10px}.legend span{margin-right:12px}"
             ".legend i{display:inline-block;width:12px;height:3px;margin:0 4px 3px 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head>"
            f"<body><h1>{html.escape(dashboard['title'])}: the last {end - start:.0f} s</h1>"
            f"<div class='grid'>{''.join(cells)}</div></body></html>")


def screenshot(html_path: Path, png_path: Path, height: int, workdir: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                    f"--screenshot={png_path}", f"--window-size=1250,{height}",
                    html_path.as_uri()], check=True, timeout=180, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not png_path.exists():
        raise RuntimeError("chromium wrote no screenshot")


def render(url: str, out: Path, seconds: float, interval_s: int, concurrency: int,
           dashboard_path: Path = DASHBOARD) -> dict[str, dict[str, int]]:
    out.mkdir(parents=True, exist_ok=True)
    dashboard = json.loads(dashboard_path.read_text())
    work = Path(tempfile.mkdtemp(prefix="render-dashboard-"))
    prom_proc, prom = start_prometheus(urllib.parse.urlsplit(url).netloc, work, interval_s)
    try:
        model = model_name(url)
        wait_scraped(prom, 'up{job="deepinfer"}', 1, timeout=60)
        start = time.time()
        send_traffic(url, model, seconds, concurrency)
        # Until Prometheus has scraped the end of the traffic: the server's count as now.
        wait_scraped(prom, "sum(vllm:request_success_total)", finished_requests(url),
                     timeout=60)
        time.sleep(interval_s)  # one more scrape: the gauges back at rest
        end = time.time()
        panels = evaluate(dashboard, prom, start - 2 * interval_s, end, interval_s,
                          f"{4 * interval_s}s")
    finally:
        prom_proc.terminate()
        prom_proc.wait(timeout=30)
    html_path, png_path = out / "dashboard.html", out / "dashboard.png"
    html_path.write_text(page(dashboard, panels, start - 2 * interval_s, end))
    rows = (len(panels) + 1) // 2
    screenshot(html_path, png_path, 60 + rows * (PANEL_H + 86), work)
    shutil.rmtree(work, ignore_errors=True)
    summary = {p["title"]: {"series": len(p["series"]), "points": finite_points(p)}
               for p in panels}
    (out / "panels.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the DeepInfer server, e.g. "
                        "http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, required=True, help="folder for the page, the "
                        "PNG and panels.json")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to send traffic")
    parser.add_argument("--scrape-interval", type=int, default=1, help="seconds")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = parser.parse_args()
    for tool in ("prometheus", "chromium"):
        if shutil.which(tool) is None:
            print(f"{tool} is not on PATH (Debian: apt-get install {tool})", file=sys.stderr)
            return 2
    summary = render(args.url.rstrip("/"), args.out, args.seconds, args.scrape_interval,
                     args.concurrency, args.dashboard)
    empty = [title for title, s in summary.items() if not s["points"]]
    for title, s in summary.items():
        print(f"{title}: {s['series']} series, {s['points']} points")
    print(f"wrote {args.out / 'dashboard.png'}")
    if empty:
        print(f"panels without data: {empty}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
