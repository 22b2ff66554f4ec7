#!/usr/bin/env python
"""Run every benchmark in bench/ and write docs/benchmarks.md (and PNG charts under docs/bench/).

    .venv/bin/python bench/run_all.py            # every bench at full size (~40 minutes on 2 busy cores)
    .venv/bin/python bench/run_all.py --quick    # the smaller sizes each bench offers (15-40 minutes, with the load)
    .venv/bin/python bench/run_all.py --only fairness,poller   # these again, the rest kept from the last run
    .venv/bin/python bench/run_all.py --rewrite  # the page and charts again from the last run's results

Each bench is a script that prints its figures as ratios against a baseline it measures in the
same run, and writes them as one JSON document to `--json PATH` (bench/reporting.py). This runs
them one after another (never side by side: they would measure each other), each with `--json`
naming a file under var/bench/run_all/, shows their output and progress lines as they come (and
a line when one has been quiet for ten seconds), and writes one page with the machine, the date,
a headline per bench (the `summary` lines of its document and its targets' verdicts) and the full
printed outputs: the page is built from the documents, never from the printed text. Any
bench/*.py this file does not know (a new one) runs with no arguments but `--json`; the helper
modules in HELPERS do not run. A bench that fails, or writes no document, is reported as failed
on the page, the others still run, and the command exits non-zero.

`--only` runs the named benches and keeps every other row of the last run (docs/bench/results.json):
a row carries the date it was measured, shown beside its time when it differs from the page's.
What is written by hand about runs this script does not make (a million-run history, a
production-sized database) lives in `bench/notes.md`, which the page carries after its table.

The charts are PNG files drawn with matplotlib by bench/plots.py from the benches' figures:
poller tick vs parked runs, admission vs waiters, throughput vs worker processes, contended
throughput vs the cap, Jain's index under fairness="key" vs FIFO, worker RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TextIO

import plots
import reporting

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs"
CHARTS = DOCS / "bench"

#: Known benches in the order they run, with their arguments at full size and in --quick mode.
#: A script may appear twice (SQLite and PostgreSQL runs of the poller bench). Where the size is
#: the figure (100,000 parked runs or runs of history, 5,000 workflows of RSS), --quick keeps it
#: and shortens only the rest.
KNOWN: list[tuple[str, str, list[str], list[str]]] = [
    ("poller (SQLite)", "poller.py", [], ["--ticks", "20"]),
    ("poller (PostgreSQL)", "poller.py", ["--postgres"], ["--postgres", "--ticks", "20"]),
    ("admission", "admission.py", [], ["--quick"]),
    ("waiters", "waiters.py", [], ["--quick"]),
    ("quota", "quota.py", [], ["--quick"]),
    ("start_control", "start_control.py", [], ["--quick"]),
    ("transport", "transport.py", [], ["--quick"]),
    ("caps", "caps.py", [], ["--quick"]),
    ("fairness", "fairness.py", [], []),
    ("rss", "rss.py", [], []),
    ("history", "history.py", [], []),  # 600 runs a timing, 5 rounds: --quick would shrink the history
    # The poller's purge of 1,000,000 finished runs on PostgreSQL, in alternating windows until it
    # is all gone: an hour or more (hours on a busy host, where the purge slows down).
    ("retention", "retention.py", ["--postgres", "--history", "1000000"], ["--history", "40000", "--max-pairs", "3"]),
    ("sqlite_processes", "sqlite_processes.py", [], []),  # 1,000 runs a timing, 3 rounds (~2 minutes)
    # 1, 2, 4 `db` worker processes on one queue on PostgreSQL: the scaling curve and its targets.
    ("sqlite_processes (PostgreSQL)", "sqlite_processes.py", ["--postgres"], ["--postgres", "--quick"]),
    ("hotpath (SQLite)", "hotpath.py", [], ["--runs", "50"]),
    ("hotpath (PostgreSQL)", "hotpath.py", ["--postgres"], ["--postgres", "--runs", "50"]),
    ("peer_dbos (SQLite)", "peer_dbos.py", [], []),  # the target's N (500) in --quick too
    ("peer_dbos (PostgreSQL)", "peer_dbos.py", ["--postgres"], ["--postgres"]),
    ("contention", "contention.py", [], ["--quick"]),
    # The production-sized history (1,000,000 finished runs) is the figure: minutes to load.
    ("surfaces", "surfaces.py", ["--scale", "1"], ["--scale", "0.1"]),
    ("index_cost", "index_cost.py", ["--lifecycles", "20000", "--rounds", "5"], []),
    ("cel_keys", "cel_keys.py", [], ["--quick"]),
    ("pg_admission", "pg_admission.py", [], ["--rounds", "1", "--runs", "200"]),
    ("latency", "latency.py", [], ["--runs", "30", "--rounds", "1"]),
    ("cluster_admission", "cluster_admission.py", [], ["--quick"]),
    ("capacity", "capacity.py", [], ["--quick"]),
    ("timers", "timers.py", [], ["--runs", "20", "--rounds", "1"]),
    ("run_end_notify", "run_end_notify.py", [], ["--rounds", "2", "--seconds", "2"]),
    # Minutes of steady load per arm, side by side: the figure is the last minutes against the first.
    ("sustained", "sustained.py", ["--minutes", "30", "--arm", "baseline,tuned"], ["--minutes", "2"]),
]
#: Modules in bench/ that other benches import; not benches themselves.
HELPERS = {"run_all.py", "__init__.py", "plots.py", "fleet.py", "reporting.py", "services.py"}
#: Where the benches' JSON documents of a run go, one a run (var/ is not committed).
RUN_DIR = ROOT / "var" / "bench" / "run_all"
#: Seconds without a line from a bench before this prints that it is still running.
QUIET_S = 10.0


@dataclass
class Result:
    """One bench's run: its command, time, exit status, printed output and JSON document."""

    name: str
    command: list[str]
    seconds: float
    returncode: int
    output: str
    errors: str = ""  # the last lines of its stderr
    report: dict[str, Any] | None = None
    problem: str = ""  # why there is no report (a failure, no JSON, a JSON that is not a report)
    when: str = ""  # when it ran ("YYYY-MM-DD HH:MM UTC")

    @property
    def failed(self) -> bool:
        return self.returncode != 0 or self.report is None


def plan(quick: bool, only: set[str] | None) -> list[tuple[str, list[str]]]:
    """(name, argv) of every bench to run: the known ones present, then any other script."""
    present = {path.name for path in BENCH.glob("*.py")} - HELPERS
    runs = [(name, [script, *(fast if quick else full)]) for name, script, full, fast in KNOWN if script in present]
    known = {script for _, script, _, _ in KNOWN}
    runs += [(path.removesuffix(".py"), [path]) for path in sorted(present - known)]
    if only:
        runs = [(name, argv) for name, argv in runs if argv[0].removesuffix(".py") in only or name in only]
    return runs


def slug(name: str) -> str:
    """A file name for a run's name: "poller (SQLite)" -> "poller-sqlite"."""
    return "-".join("".join(c if c.isalnum() or c == "_" else " " for c in name.lower()).split())


def run(name: str, argv: list[str], directory: Path = RUN_DIR, timeout_s: float | None = None) -> Result:
    """Run one bench with `--json <directory>/<slug>.json`, its stdout and stderr shown as they
    come (and a line when it has been quiet for QUIET_S), and read the JSON it wrote."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug(name)}.json"
    path.unlink(missing_ok=True)  # never read a previous run's figures as this one's
    command = [sys.executable, str(BENCH / argv[0]), *argv[1:], "--json", str(path)]
    print(f"== {name}: {' '.join(argv)}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its lines as they are printed, not at its exit
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout stops it and the workers it started
    )
    output: list[str] = []
    errors: deque[str] = deque(maxlen=40)
    heard = [time.monotonic()]

    def pump(stream: IO[str], into: list[str] | deque[str], echo: TextIO) -> None:
        for line in stream:
            into.append(line)
            heard[0] = time.monotonic()
            echo.write(f"   {line}" if echo is sys.stderr else line)
            echo.flush()

    pumps = [
        threading.Thread(target=pump, args=(proc.stdout, output, sys.stdout), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, errors, sys.stderr), daemon=True),
    ]
    for thread in pumps:
        thread.start()
    timed_out = False
    while proc.poll() is None:
        now = time.monotonic()
        if timeout_s is not None and now - started > timeout_s:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            break
        if now - heard[0] >= QUIET_S:
            print(f"   ({name}: still running, {now - started:.0f} s)", file=sys.stderr, flush=True)
            heard[0] = now
        time.sleep(0.5)
    for thread in pumps:
        thread.join(10)
    result = Result(name, argv, time.monotonic() - started, proc.returncode, "".join(output).rstrip())
    result.errors = "".join(errors).rstrip()
    result.report, result.problem = read_report(path)
    if timed_out:
        result.problem = f"timed out after {timeout_s:.0f} s"
    elif proc.returncode != 0:
        last = result.errors.splitlines()[-1] if result.errors else "no stderr"
        result.problem = f"exit {proc.returncode}: {last}"
    print(f"   ({result.seconds:.0f} s, exit {proc.returncode}{f'; {result.problem}' if result.problem else ''})\n")
    return result


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def merged(kept: list[Result], fresh: list[Result]) -> list[Result]:
    """The last run's rows with the fresh ones in their place, in the order the benches run."""
    order = {name: i for i, (name, _) in enumerate(plan(False, None))}
    by_name = {result.name: result for result in kept} | {result.name: result for result in fresh}
    return sorted(by_name.values(), key=lambda result: order.get(result.name, len(order)))


def read_report(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A bench's JSON document, or None and why not."""
    try:
        return reporting.read_json(path), ""
    except FileNotFoundError:
        return None, f"wrote no JSON to {path.name} (every bench takes --json PATH: docs/benchmarks.md)"
    except reporting.ReportError as exc:
        return None, str(exc)


def headlines(result: Result) -> list[str]:
    """A bench's lines in the summary table: its own summary, then its targets' verdict."""
    if result.failed:
        return [f"**failed**: {result.problem}"]
    assert result.report is not None
    lines = [str(line).strip() for line in result.report["summary"]]
    targets = result.report["targets"]
    missed = [entry for entry in targets if not entry["met"]]
    if missed:
        lines += [
            f"**MISSED** {entry['name']}: {shown(entry['value'])} (target {entry['op']} {entry['bound']:g})"
            for entry in missed
        ]
    if targets:
        lines.append(f"targets met: {len(targets) - len(missed)} of {len(targets)}")
    return lines


def shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "not measured" if value is None else str(value)


# -- the page ------------------------------------------------------------------------------------
HOW_TO = """\
How to run them, and where their figures go: every script in `bench/` prints its figures for a
reader and writes them as one JSON document for programs (`bench/reporting.py`), to
`--json PATH` (default `var/bench/<bench>.json`); `bench/run_all.py` passes
`--json var/bench/run_all/<run>.json` to each bench it runs and builds this page from those
documents (and its charts from their figures), never from the printed text. A document holds
`bench`, `when`, `argv`, `machine` (CPUs, Python, Django, PostgreSQL and Redis versions, load
average), `figures` (the bench's own: medians, worst rounds, ratios, per-round values),
`summary` (its lines in the table below) and `targets` (each a figure, its bound and whether it
was met). Long set-ups and runs print progress lines on stderr (rows loaded, rounds done,
elapsed, time left); `run_all.py` shows them as they come. A new bench follows the same
convention: take `--json PATH` (`reporting.add_json_option`), call `reporting.write_json` at the
end, and `run_all.py` runs it with no other arguments and reads it like the others. The
sections after the table, about runs `run_all.py` does not make (a million-run history, a
production-sized database), are written by hand in `bench/notes.md`.

    .venv/bin/python bench/run_all.py --quick --only poller,fairness
    .venv/bin/python bench/poller.py --ticks 20 --json /tmp/poller.json"""


def machine_lines(about: dict[str, Any]) -> list[str]:
    """What the figures were measured on, as the page's list."""
    load = about.get("load_average") or [float("nan")]
    memory = f", {about['memory_gib']} GiB RAM" if about.get("memory_gib") else ""
    return [
        f"{about.get('cpu_model')}, {about.get('cpus')} CPUs{memory}",
        f"{about.get('platform')}; Python {about.get('python')}; Django {about.get('django')}",
        f"PostgreSQL {about.get('postgres') or 'not reachable'}; Redis {about.get('redis') or 'not reachable'}",
        f"load average {load[0]:.2f} when the run started (other work may share the machine)",
    ]


def page(
    results: list[Result],
    about: dict[str, Any],
    quick: bool,
    charts: dict[str, str],
    when: str,
    unread: list[str],
    notes: str = "",
) -> str:
    """The text of docs/benchmarks.md: the run's table, the notes written by hand, the charts and
    every bench's printed output."""
    later = any(result.when and result.when != when for result in results)
    lines = [
        "# Benchmarks",
        "",
        f"Written by `bench/run_all.py{' --quick' if quick else ''}` on {when}. Each figure is a ratio "
        "against a baseline measured in the same run; absolute numbers depend on the machine"
        + (" (a row measured at another time gives its date beside its time)" if later else "")
        + ":",
        "",
        *[f"- {line}" for line in machine_lines(about)],
        "",
        HOW_TO,
        "",
        "| bench | time | headline figures |",
        "| --- | --- | --- |",
    ]
    for result in results:
        heads = "<br>".join(line.replace("|", "\\|") for line in headlines(result)) or "see its output below"
        dated = f"<br>{result.when}" if result.when and result.when != when else ""
        lines.append(f"| `{' '.join(result.command)}` | {result.seconds:.0f} s{dated} | {heads} |")
    if notes.strip():
        lines += ["", notes.strip()]
    if charts:
        lines += ["", "## Charts", ""]
        lines += [f"![{title}](bench/{name})\n" for name, title in charts.items()]
    lines += [f"- **{complaint}**" for complaint in unread]
    lines += ["", "## Full outputs", ""]
    for result in results:
        text = result.output if not result.failed else f"{result.output}\n[stderr, last lines]\n{result.errors}"
        lines += [f"### {result.name}", "", "```", text.strip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smaller sizes each bench offers")
    parser.add_argument("--only", default="", help="comma-separated bench names (script names without .py)")
    parser.add_argument("--rewrite", action="store_true", help="rewrite the page from the last run's saved results")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a bench may take before it is stopped")
    args = parser.parse_args()
    only = {name.strip() for name in args.only.split(",") if name.strip()} or None
    saved = CHARTS / "results.json"
    last = json.loads(saved.read_text()) if saved.exists() else {}
    if not isinstance(last.get("machine"), dict):
        last = {}  # none, or one that predates the JSON reports: nothing to rewrite or keep
    if args.rewrite:
        if not last:
            raise SystemExit(f"{saved.relative_to(ROOT)} holds no run of the JSON reports: run the benches first")
        about, quick, when = last["machine"], last["quick"], last["when"]
        results = [Result(**row) for row in last["results"]]
    else:
        about, quick, when = reporting.machine(), args.quick, utc_now()
        results = [run(name, argv, timeout_s=args.timeout) for name, argv in plan(args.quick, only)]
        for result in results:
            result.when = when  # the run's date, shown beside a row kept into a later page
        if only and last:
            about, quick, when = last["machine"], last["quick"], last["when"]
            results = merged([Result(**row) for row in last["results"]], results)
    CHARTS.mkdir(parents=True, exist_ok=True)
    reports = {result.name: result.report for result in results if not result.failed and result.report}
    charts, unread = plots.render(reports, CHARTS)
    for complaint in unread:
        print(f"warning: {complaint}", file=sys.stderr)
    rows = [asdict(result) for result in results]
    saved.write_text(json.dumps({"machine": about, "quick": quick, "when": when, "results": rows}, indent=1) + "\n")
    target = DOCS / "benchmarks.md"
    notes = BENCH / "notes.md"
    target.write_text(page(results, about, quick, charts, when, unread, notes.read_text() if notes.exists() else ""))
    print(f"wrote {target.relative_to(ROOT)}" + (f" and {len(charts)} chart(s) in docs/bench/" if charts else ""))
    failed = [result.name for result in results if result.failed]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
