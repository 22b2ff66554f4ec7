#!/usr/bin/env python
"""Run every benchmark in bench/ and write docs/benchmarks.md (and SVG charts under docs/bench/).

    .venv/bin/python bench/run_all.py            # every bench at full size (~10 minutes)
    .venv/bin/python bench/run_all.py --quick    # the smaller sizes each bench offers
    .venv/bin/python bench/run_all.py --only fairness,poller

Each bench is a script that prints its figures as ratios against a baseline it measures in the
same run; this runs them one after another (never side by side: they would measure each other),
keeps each one's full output, and writes one page with the machine, the date, a headline per
bench (its lines naming a ratio, a target or a verdict) and the full outputs. Any bench/*.py this
file does not know (a new one, e.g. bench/contention.py) runs with no arguments. A bench that
fails is reported as failed on the page, and the command exits non-zero.

Charts are plain SVG written here (no plotting dependency): workflows/s against worker processes
(bench/transport.py) and Jain's index per backend under fairness="key" and FIFO
(bench/fairness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs"
CHARTS = DOCS / "bench"

#: Known benches in the order they run, with their arguments at full size and in --quick mode.
#: A script may appear twice (SQLite and PostgreSQL runs of the poller bench).
KNOWN: list[tuple[str, str, list[str], list[str]]] = [
    ("poller (SQLite)", "poller.py", [], ["--parked", "20000", "--ticks", "20"]),
    ("poller (PostgreSQL)", "poller.py", ["--postgres"], ["--postgres", "--parked", "20000", "--ticks", "20"]),
    ("admission", "admission.py", [], ["--quick"]),
    ("quota", "quota.py", [], ["--quick"]),
    ("start_control", "start_control.py", [], ["--quick"]),
    ("transport", "transport.py", [], ["--quick"]),
    ("fairness", "fairness.py", ["--json"], ["--json"]),
    ("contention", "contention.py", [], []),  # the lead's; its options are its own
]
HEADLINE = re.compile(r"ratio|target|overshoot|jain|verdict|worst", re.IGNORECASE)


@dataclass
class Result:
    name: str
    command: list[str]
    seconds: float
    returncode: int
    output: str
    headlines: list[str] = field(default_factory=list)


def plan(quick: bool, only: set[str] | None) -> list[tuple[str, list[str]]]:
    """(name, argv) of every bench to run: the known ones present, then any other script."""
    present = {path.name for path in BENCH.glob("*.py")} - {"run_all.py", "__init__.py"}
    runs = [(name, [script, *(fast if quick else full)]) for name, script, full, fast in KNOWN if script in present]
    known = {script for _, script, _, _ in KNOWN}
    runs += [(path.removesuffix(".py"), [path]) for path in sorted(present - known)]
    if only:
        runs = [(name, argv) for name, argv in runs if argv[0].removesuffix(".py") in only or name in only]
    return runs


def run(name: str, argv: list[str]) -> Result:
    command = [sys.executable, str(BENCH / argv[0]), *argv[1:]]
    print(f"== {name}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    output = (done.stdout + (f"\n[stderr]\n{done.stderr}" if done.returncode else "")).strip()
    result = Result(name, argv, time.perf_counter() - started, done.returncode, output)
    result.headlines = headlines(result)
    print(output + f"\n   ({result.seconds:.0f} s, exit {done.returncode})\n", flush=True)
    return result


def headlines(result: Result) -> list[str]:
    """The lines of a bench's output worth a place in the summary table."""
    if result.returncode != 0:
        return []
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    if result.name == "fairness":
        return fairness_headlines(json.loads(result.output))
    if result.name.startswith("poller"):
        return [line for line in lines if "parked not-due" in line or line.startswith("ratio")]
    if result.name == "admission":
        table = re.compile(r"^(backend|local|db \(|redis)|worst|of the floor")
        return [re.sub(r"\s{2,}", "  ", line) for line in lines if table.search(line)]
    if result.name == "transport":
        rows = [line.split() for line in lines]
        return [
            f"{row[0]} process(es): raw RQ {row[1]} jobs/s; durable_flow over rq {row[2]} wf/s"
            f" (ratio {row[3]}), over db {row[4]} wf/s (ratio {row[5]})"
            for row in rows
            if len(row) == 6 and row[0].isdigit()
        ]
    return [line for line in lines if HEADLINE.search(line)]


def fairness_headlines(data: dict) -> list[str]:
    rows = [
        f'{name}: Jain {row["key"]["jain"]:.3f} under fairness="key" vs {row["fifo"]["jain"]:.3f} under FIFO'
        for name, row in data["backends"].items()
    ]
    worst = min(row["key"]["jain"] for row in data["backends"].values())
    verdict = "met" if worst >= 0.99 else "MISSED"
    return [*rows, f'target Jain >= 0.99 under fairness="key" ({data["tenants"]} tenants, one flooding): {verdict}']


# -- charts --------------------------------------------------------------------------------------
def bar_chart(title: str, groups: list[str], series: dict[str, list[float]], unit: str) -> str:
    """A grouped bar chart as a standalone SVG document."""
    width, height, left, bottom, top = 640, 320, 60, 40, 40
    colours = ["#4c78a8", "#f58518", "#54a24b", "#e45756"]
    peak = max((v for values in series.values() for v in values), default=1) or 1
    plot_w, plot_h = width - left - 20, height - top - bottom
    group_w = plot_w / max(len(groups), 1)
    bar_w = group_w * 0.8 / max(len(series), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif"'
        f' font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
        f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})"'
        f' text-anchor="middle">{escape(unit)}</text>',
    ]
    for s, (label, values) in enumerate(series.items()):
        for g, value in enumerate(values):
            bar_h = plot_h * value / peak
            x = left + g * group_w + group_w * 0.1 + s * bar_w
            y = top + plot_h - bar_h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{bar_h:.1f}" fill="{colours[s % 4]}"/>'
            )
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">{value:.3g}</text>')
        parts.append(
            f'<rect x="{left + 10 + s * 150}" y="{height - 14}" width="10" height="10" fill="{colours[s % 4]}"/>'
            f'<text x="{left + 24 + s * 150}" y="{height - 5}">{escape(label)}</text>'
        )
    for g, group in enumerate(groups):
        x = left + g * group_w + group_w / 2
        parts.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{escape(group)}</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)


def transport_chart(result: Result) -> str | None:
    """Workflows/s (and raw RQ jobs/s) against worker processes, from bench/transport.py's table."""
    rows = [line.split() for line in result.output.splitlines()]
    rows = [row for row in rows if len(row) == 6 and all(re.fullmatch(r"[\d.]+", cell) for cell in row)]
    if not rows:
        return None
    return bar_chart(
        "Throughput vs worker processes (bench/transport.py)",
        [f"{row[0]} process(es)" for row in rows],
        {
            "raw RQ jobs/s": [float(row[1]) for row in rows],
            "durable_flow/rq wf/s": [float(row[2]) for row in rows],
            "durable_flow/db wf/s": [float(row[4]) for row in rows],
        },
        "per second",
    )


def fairness_chart(result: Result) -> str | None:
    data = json.loads(result.output)
    names = list(data["backends"])
    return bar_chart(
        f"Jain's index over {data['tenants']} tenants, one flooding (bench/fairness.py)",
        names,
        {
            'fairness="key"': [data["backends"][n]["key"]["jain"] for n in names],
            "FIFO": [data["backends"][n]["fifo"]["jain"] for n in names],
        },
        "Jain's index (1 = even)",
    )


# -- the page ------------------------------------------------------------------------------------
def machine() -> list[str]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        cpu = model.group(1).strip() if model else cpu
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total = re.search(r"MemTotal:\s*(\d+) kB", meminfo.read_text())
        memory = f"{int(total.group(1)) / 1024 / 1024:.1f} GiB RAM" if total else ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [
        f"{cpu}, {os.cpu_count()} CPUs, {memory}",
        f"{platform.platform()}; Python {platform.python_version()}",
        f"{service_version(['psql', '--version'])}; {service_version(['redis-server', '--version'])}",
        f"load average {load:.2f} when the run started (other work may share the machine)",
    ]


def service_version(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip() or command[0]
    except OSError:
        return f"{command[0]}: not found"


def write_page(results: list[Result], about: list[str], quick: bool, charts: dict[str, str], when: str) -> Path:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `bench/run_all.py{' --quick' if quick else ''}` on {when}. Each figure is a ratio "
        "against a baseline measured in the same run; absolute numbers depend on the machine:",
        "",
        *[f"- {line}" for line in about],
        "",
        "| bench | time | headline figures |",
        "| --- | --- | --- |",
    ]
    for result in results:
        status = "" if result.returncode == 0 else f"**failed (exit {result.returncode})** "
        heads = "<br>".join(line.replace("|", "\\|") for line in result.headlines) or "see its output below"
        lines.append(f"| `{' '.join(result.command)}` | {result.seconds:.0f} s | {status}{heads} |")
    if charts:
        lines += ["", "## Charts", ""]
        lines += [f"![{title}](bench/{name})" for name, title in charts.items()]
    lines += ["", "## Full outputs", ""]
    for result in results:
        lines += [f"### {result.name}", "", "```", result.output, "```", ""]
    page = DOCS / "benchmarks.md"
    page.write_text("\n".join(lines).rstrip() + "\n")
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smaller sizes each bench offers")
    parser.add_argument("--only", default="", help="comma-separated bench names (script names without .py)")
    parser.add_argument("--rewrite", action="store_true", help="rewrite the page from the last run's saved outputs")
    args = parser.parse_args()
    only = {name.strip() for name in args.only.split(",") if name.strip()} or None
    saved = CHARTS / "results.json"
    if args.rewrite:
        data = json.loads(saved.read_text())
        about, quick, when = data["machine"], data["quick"], data["when"]
        results = [Result(**row) for row in data["results"]]
        for result in results:
            result.headlines = headlines(result)
    else:
        about, quick, when = machine(), args.quick, datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        results = [run(name, argv) for name, argv in plan(args.quick, only)]
    CHARTS.mkdir(parents=True, exist_ok=True)
    charts: dict[str, str] = {}
    for result in results:
        if result.returncode != 0:
            continue
        makers = {"transport": ("transport.svg", transport_chart), "fairness": ("fairness.svg", fairness_chart)}
        if result.name in makers:
            filename, make = makers[result.name]
            svg = make(result)
            if svg:
                (CHARTS / filename).write_text(svg)
                charts[filename] = f"{result.name} chart"
    rows = [{k: v for k, v in vars(result).items() if k != "headlines"} for result in results]
    saved.write_text(json.dumps({"machine": about, "quick": quick, "when": when, "results": rows}, indent=1) + "\n")
    page = write_page(results, about, quick, charts, when)
    print(f"wrote {page.relative_to(ROOT)}" + (f" and {len(charts)} chart(s) in docs/bench/" if charts else ""))
    if any(result.returncode != 0 for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
