#!/usr/bin/env python
"""Run every benchmark in bench/ and write docs/benchmarks.md (and PNG charts under docs/bench/).

    .venv/bin/python bench/run_all.py            # every bench at full size (~40 minutes on 2 busy cores)
    .venv/bin/python bench/run_all.py --quick    # the smaller sizes each bench offers (15-40 minutes, with the load)
    .venv/bin/python bench/run_all.py --only fairness,poller
    .venv/bin/python bench/run_all.py --rewrite  # the page and charts again from the last run's outputs

Each bench is a script that prints its figures as ratios against a baseline it measures in the
same run; this runs them one after another (never side by side: they would measure each other),
keeps each one's full output, and writes one page with the machine, the date, a headline per
bench (its lines naming a ratio, a target or a verdict) and the full outputs. Any bench/*.py this
file does not know (a new one) runs with no arguments; the helper modules in HELPERS do not run.
A bench that fails is reported as failed on the page, and the command exits non-zero.

The charts are PNG files drawn with matplotlib by bench/plots.py, from the benches' printed
output: poller tick vs parked runs, admission vs waiters, throughput vs worker processes,
contended throughput vs the cap, Jain's index under fairness="key" vs FIFO, worker RSS.
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
from pathlib import Path

import plots

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs"
CHARTS = DOCS / "bench"

#: Known benches in the order they run, with their arguments at full size and in --quick mode.
#: A script may appear twice (SQLite and PostgreSQL runs of the poller bench). Where the size is
#: the figure (100,000 parked runs or runs of history, 5,000 workflows of RSS: issues 14 and 15),
#: --quick keeps it and shortens only the rest.
KNOWN: list[tuple[str, str, list[str], list[str]]] = [
    ("poller (SQLite)", "poller.py", [], ["--ticks", "20"]),
    ("poller (PostgreSQL)", "poller.py", ["--postgres"], ["--postgres", "--ticks", "20"]),
    ("admission", "admission.py", [], ["--quick"]),
    ("waiters", "waiters.py", [], ["--quick"]),
    ("quota", "quota.py", [], ["--quick"]),
    ("start_control", "start_control.py", [], ["--quick"]),
    ("transport", "transport.py", [], ["--quick"]),
    ("caps", "caps.py", [], ["--quick"]),
    ("fairness", "fairness.py", ["--json"], ["--json"]),
    ("rss", "rss.py", [], []),
    ("history", "history.py", [], []),  # 600 runs a timing, 5 rounds: --quick would shrink the history
    ("sqlite_processes", "sqlite_processes.py", [], []),  # 1,000 runs a timing, 3 rounds (~2 minutes)
    ("hotpath (SQLite)", "hotpath.py", [], ["--runs", "50"]),
    ("hotpath (PostgreSQL)", "hotpath.py", ["--postgres"], ["--postgres", "--runs", "50"]),
    ("peer_dbos (SQLite)", "peer_dbos.py", [], []),  # the N (500) in --quick too
    ("peer_dbos (PostgreSQL)", "peer_dbos.py", ["--postgres"], ["--postgres"]),
    ("contention", "contention.py", [], ["--quick"]),
    # The production-sized history (1,000,000 finished runs) is the figure: minutes to load.
    ("surfaces", "surfaces.py", ["--scale", "1"], ["--scale", "0.1"]),
    ("index_cost", "index_cost.py", ["--lifecycles", "20000", "--rounds", "5"], []),
]
#: Modules in bench/ that other benches import; not benches themselves.
HELPERS = {"run_all.py", "__init__.py", "plots.py", "fleet.py"}
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
    present = {path.name for path in BENCH.glob("*.py")} - HELPERS
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
            f" (ratio {row[3]}), over rq with OPTIMISTIC_FIRST_STEP off {row[4]} wf/s (ratio {row[5]}),"
            f" over rq with every step a job {row[6]} wf/s (ratio {row[7]}), over db {row[8]} wf/s (ratio {row[9]})"
            for row in rows
            if len(row) == 10 and row[0].isdigit()
        ] + [line for line in lines if line.startswith(("target", "worst", "rounds", "cpu"))]
    if result.name == "waiters":
        return lines[next(i for i, line in enumerate(lines) if line.startswith("ratio")) :]
    if result.name in ("rss", "history"):
        return [line for line in lines if re.search(r"MiB|KiB|wf/s|ratio|worst", line) and "each tenth" not in line]
    if result.name.startswith("peer_dbos"):
        return [line for line in lines if "(median)" in line or HEADLINE.search(line)]
    if result.name.startswith("hotpath"):
        return lines[next((i for i, line in enumerate(lines) if line.startswith("summary")), len(lines)) :]
    if result.name == "contention":
        passed = sum(line.endswith("PASS") for line in lines)
        missed = [re.sub(r"\s{2,}", "  ", line) for line in lines if line.endswith("MISS")]
        return [*missed, f"{passed} other targets: PASS"]
    return [line for line in lines if HEADLINE.search(line)]


def fairness_headlines(data: dict) -> list[str]:
    rows = [
        f'{name}: Jain {row["key"]["jain"]:.3f} under fairness="key" vs {row["fifo"]["jain"]:.3f} under FIFO'
        for name, row in data["backends"].items()
    ]
    worst = min(row["key"]["jain"] for row in data["backends"].values())
    verdict = "met" if worst >= 0.99 else "MISSED"
    return [*rows, f'target Jain >= 0.99 under fairness="key" ({data["tenants"]} tenants, one flooding): {verdict}']


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


def write_page(
    results: list[Result], about: list[str], quick: bool, charts: dict[str, str], when: str, unread: list[str]
) -> Path:
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
        lines += [f"![{title}](bench/{name})\n" for name, title in charts.items()]
    lines += [f"- **{complaint}**" for complaint in unread]
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
    charts, unread = plots.render({result.name: result.output for result in results if result.returncode == 0}, CHARTS)
    for complaint in unread:
        print(f"warning: {complaint}", file=sys.stderr)
    rows = [{k: v for k, v in vars(result).items() if k != "headlines"} for result in results]
    saved.write_text(json.dumps({"machine": about, "quick": quick, "when": when, "results": rows}, indent=1) + "\n")
    page = write_page(results, about, quick, charts, when, unread)
    print(f"wrote {page.relative_to(ROOT)}" + (f" and {len(charts)} chart(s) in docs/bench/" if charts else ""))
    if any(result.returncode != 0 for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
