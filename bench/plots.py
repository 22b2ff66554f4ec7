"""The PNG charts of docs/benchmarks.md, drawn with matplotlib from the benches' JSON figures.

bench/run_all.py hands `render` each bench's JSON document (bench/reporting.py) by the name of
its run; every chart reads the figures of the benches it draws, never their printed text. A
chart whose bench did not run, or failed, is skipped; one whose bench ran but whose figures
lack what the chart reads is reported (the figures changed under the chart).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

#: {run name (e.g. "poller (SQLite)"): that run's JSON document}
Reports = dict[str, dict[str, Any]]


def figures(reports: Reports, bench: str) -> dict[str, Any] | None:
    """The figures of the run named `bench`, or None if it did not run."""
    doc = reports.get(bench)
    return doc["figures"] if doc else None


def poller_chart(reports: Reports) -> Figure | None:
    """Tick time against parked not-due runs, per database, with its empty-table baseline."""
    series = {
        name.removeprefix("poller ").strip("()"): [(row["parked"], row["tick_ms"]) for row in doc["figures"]["sizes"]]
        for name, doc in reports.items()
        if name.startswith("poller")
    }
    series = {name: points for name, points in series.items() if len(points) > 1}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    for (name, points), colour in zip(series.items(), ("C0", "C1"), strict=False):
        base = points[0][1]
        sizes, times = zip(*points[1:], strict=True)
        ax.plot(sizes, times, "o-", color=colour, label=f"{name}: tick waking 100 due runs")
        ax.axhline(base, color=colour, linestyle="--", linewidth=1, label=f"{name}: same, 0 parked (baseline)")
        ax.axhline(base * 1.5, color=colour, linestyle=":", linewidth=1, label=f"{name}: target ceiling 1.5x")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("parked not-due runs")
    ax.set_ylabel("median tick (ms)")
    ax.set_title("Poller tick vs parked runs (bench/poller.py)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot, off the points
    return fig


def waiters_chart(reports: Reports) -> Figure | None:
    """Cap-full decisions/s and handoffs/s against the waiters in line, per backend (log-log)."""
    data = figures(reports, "waiters")
    if data is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharex=True)
    kinds = (("cap-full decision", "cap_full"), ("release + grant (handoff)", "rank"))
    for ax, (title, kind) in zip(axes, kinds, strict=True):
        for backend, by_size in data["backends"].items():
            points = sorted((int(size), row[kind]["per_s"]) for size, row in by_size.items())
            ax.plot(*zip(*points, strict=True), "o-", label=backend)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("waiters in line")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("per second")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("Admission vs waiters (bench/waiters.py)")
    fig.set_layout_engine("tight", rect=(0, 0.07, 1, 1))  # room for the legend below
    return fig


def transport_chart(reports: Reports) -> Figure | None:
    """Throughput against worker processes, and durable_flow over rq as a ratio of raw RQ."""
    data = figures(reports, "transport")
    if data is None:
        return None
    # The printed table's columns: processes, raw RQ, over rq and its ratio (the median of the
    # rounds'), then rq-locked, rq-jobs and db, each with its ratio to the median raw RQ rate.
    rows = []
    for processes, row in sorted(data["processes"].items(), key=lambda item: int(item[0])):
        raw = row["raw_jobs_s"]
        rows.append(
            [
                int(processes),
                raw,
                row["rq_wf_s"],
                row["ratio"],
                row["rq_locked_wf_s"],
                row["rq_locked_wf_s"] / raw,
                row["rq_jobs_wf_s"],
                row["rq_jobs_wf_s"] / raw,
                row["db_wf_s"],
                row["db_wf_s"] / raw,
            ]
        )
    if not rows:
        return None
    procs = [row[0] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    for index, label in (
        (1, "raw RQ SimpleWorker, jobs/s"),
        (2, "durable_flow over rq, wf/s"),
        (4, "over rq, OPTIMISTIC_FIRST_STEP off, wf/s"),
        (6, "over rq, every step a job, wf/s"),
        (8, "durable_flow over db, wf/s"),
    ):
        left.plot(procs, [row[index] for row in rows], "o-", label=label)
    left.set_ylabel("per second")
    left.set_ylim(0, max(max(row[1], row[2], row[4], row[6], row[8]) for row in rows) * 1.4)  # room for the legend
    left.set_title("throughput", fontsize=10)
    left.legend(fontsize=8, loc="upper left")
    right.plot(procs, [row[3] for row in rows], "o-", color="C1", label="over rq / raw RQ")
    right.plot(procs, [row[5] for row in rows], "o-", color="C2", label="OPTIMISTIC_FIRST_STEP off / raw RQ")
    right.plot(procs, [row[7] for row in rows], "o-", color="C3", label="every step a job / raw RQ")
    right.plot(procs, [row[9] for row in rows], "o-", color="C4", label="over db / raw RQ")
    right.axhline(0.5, color="grey", linestyle="--", linewidth=1, label="target 0.5 (over rq)")
    right.set_ylim(0, max(1.0, max(max(row[3], row[5], row[7], row[9]) for row in rows) * 1.1))
    right.set_title("ratio to raw RQ, same processes", fontsize=10)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(procs, [f"{p:g}" for p in procs])
        ax.set_xlabel("worker processes")
        ax.set_ylim(bottom=0)
    fig.suptitle("End-to-end throughput vs worker processes (bench/transport.py, PostgreSQL)")
    return fig


def caps_chart(reports: Reports) -> Figure | None:
    """Steps/s through one contended queue against its cap, per stack, with the ideal cap / step."""
    data = figures(reports, "caps")
    if data is None:
        return None
    stacks = {stack: by_cap for stack, by_cap in data["stacks"].items() if "error" not in by_cap}
    if not stacks:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    caps = sorted(data["caps"])
    ax.plot(caps, [cap / data["step_s"] for cap in caps], "k--", linewidth=1, label="ideal: cap / step time")
    for index, (stack, by_cap) in enumerate(stacks.items()):
        points = [(cap, by_cap[str(cap)]["steps_s"]) for cap in caps]
        ax.plot(*zip(*points, strict=True), "o-", label=stack)
        # One stack's labels up and to the left of its points, the next's down and to the right.
        offset, align = ((-6, 4), "right") if index % 2 == 0 else ((6, -12), "left")
        for cap, rate in points:
            ax.annotate(f"{rate:.3g}", (cap, rate), textcoords="offset points", xytext=offset, ha=align, fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(caps, [str(cap) for cap in caps])
    ax.margins(x=0.1)  # room for the last point's label
    ax.set_xlabel("queue concurrency (cap)")
    ax.set_ylabel("steps started per second")
    ax.set_title("Contended throughput vs the cap, 50 ms steps (bench/caps.py)")
    ax.legend(fontsize=8)
    return fig


def fairness_chart(reports: Reports) -> Figure | None:
    """Jain's index per backend under fairness="key" and FIFO, against the 0.99 target."""
    data = figures(reports, "fairness")
    if data is None:
        return None
    names = list(data["backends"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    for shift, (mode, label) in ((-width / 2, ("key", 'fairness="key"')), (width / 2, ("fifo", "FIFO"))):
        values = [data["backends"][name][mode]["jain"] for name in names]
        bars = ax.bar([i + shift for i in range(len(names))], values, width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.axhline(0.99, color="grey", linestyle="--", linewidth=1, label="target 0.99")
    ax.axhline(1 / data["tenants"], color="grey", linestyle=":", linewidth=1, label="1/n: one tenant takes all")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.35)  # headroom for the legend; the index stops at 1
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("Jain's index of admissions per tenant")
    ax.set_title(f"Fairness: {data['tenants']} tenants, one flooding (bench/fairness.py)")
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    return fig


def rss_chart(reports: Reports) -> Figure | None:
    """The worker's RSS at each tenth of its workflows."""
    data = figures(reports, "rss")
    if data is None:
        return None
    runs, values = data["runs"], data["tenths_mib"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([runs * k / 10 for k in range(1, len(values) + 1)], values, "o-")
    ax.set_ylim(0, max(values) * 1.2)
    ax.set_xlabel("workflows completed")
    ax.set_ylabel("worker RSS (MiB)")
    ax.set_title("Worker memory over a long run (bench/rss.py)")
    return fig


#: file name: (title, the bench whose output it draws (a name prefix), the drawing).
CHARTS: dict[str, tuple[str, str, Callable[[Reports], Figure | None]]] = {
    "poller.png": ("Poller tick vs parked runs", "poller", poller_chart),
    "waiters.png": ("Admission vs waiters", "waiters", waiters_chart),
    "transport.png": ("Throughput vs worker processes", "transport", transport_chart),
    "caps.png": ("Contended throughput vs the cap", "caps", caps_chart),
    "fairness.png": ("Fairness: Jain's index", "fairness", fairness_chart),
    "rss.png": ("Worker RSS over a long run", "rss", rss_chart),
}


def render(reports: Reports, directory: Path) -> tuple[dict[str, str], list[str]]:
    """Write every chart the reports allow into `directory`: {file name: title} of those written,
    and a complaint for each chart whose bench ran but whose figures it could not read (they
    changed under the chart)."""
    written: dict[str, str] = {}
    unread: list[str] = []
    for filename, (title, bench, make) in CHARTS.items():
        try:
            fig = make(reports)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            plt.close("all")
            unread.append(
                f"{filename} not drawn: bench {bench!r} ran, but its figures lack what the chart reads ({exc!r})"
            )
            continue
        if fig is None:
            if any(name.startswith(bench) for name in reports):
                unread.append(
                    f"{filename} not drawn: bench {bench!r} ran, but its figures have nothing the chart reads"
                )
            continue
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        fig.savefig(directory / filename, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written[filename] = title
    return written, unread
