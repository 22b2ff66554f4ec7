"""bench/reporting.py: the JSON document every bench writes, and its throttled progress lines."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import pytest
import reporting


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_written_document_reads_back_with_its_figures_summary_and_targets(tmp_path: Path) -> None:
    path = reporting.write_json(
        "demo",
        {"ratio": 0.96, "rounds": [0.93, 0.96, 0.98], "by_size": {100: 1.0}},
        path=tmp_path / "deep" / "demo.json",
        summary=["ratio 0.96"],
        targets=[reporting.target("ratio", 0.96, ">=", 0.9)],
        about={"cpus": 2},
    )
    doc = reporting.read_json(path)
    assert doc["bench"] == "demo"
    assert doc["machine"] == {"cpus": 2}
    assert doc["figures"] == {"ratio": 0.96, "rounds": [0.93, 0.96, 0.98], "by_size": {"100": 1.0}}
    assert doc["summary"] == ["ratio 0.96"]
    assert doc["targets"] == [{"name": "ratio", "value": 0.96, "op": ">=", "bound": 0.9, "met": True}]
    assert not list(path.parent.glob(".*.tmp")), "the temporary file was renamed over the document"


def test_nan_and_infinity_are_written_as_null_so_the_document_is_strict_json(tmp_path: Path) -> None:
    path = reporting.write_json("demo", {"a": math.nan, "b": [math.inf]}, path=tmp_path / "d.json", about={})
    assert json.loads(path.read_text())["figures"] == {"a": None, "b": [None]}


def test_the_default_path_is_var_bench_name_json() -> None:
    assert reporting.default_path("poller") == reporting.ROOT / "var" / "bench" / "poller.json"


@pytest.mark.parametrize(
    ("value", "op", "bound", "met"),
    [(0.96, ">=", 0.9, True), (0.89, ">=", 0.9, False), (1.6, "<", 1.5, False), (0, "==", 0, True)],
)
def test_a_target_is_met_by_its_operator(value: float, op: str, bound: float, met: bool) -> None:
    assert reporting.target("figure", value, op, bound)["met"] is met


@pytest.mark.parametrize("value", [None, math.nan])
def test_a_figure_that_was_not_measured_never_meets_its_target(value: float | None) -> None:
    assert reporting.target("figure", value, "<=", 1.5)["met"] is False


def test_an_unknown_operator_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown operator"):
        reporting.target("figure", 1.0, "~", 1.0)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("not json", "not JSON"),
        ("[]", "not an object"),
        ('{"schema": 0}', "schema 0"),
        ('{"schema": 1, "bench": "x"}', "missing when, figures, summary, targets"),
        (
            '{"schema": 1, "bench": "x", "when": "", "figures": {}, "summary": [], "targets": [{"name": "x"}]}',
            "a target needs",
        ),
    ],
)
def test_a_document_that_is_not_a_report_is_refused_with_the_reason(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(reporting.ReportError, match=complaint):
        reporting.read_json(path)


def test_the_machine_facts_name_the_cpus_python_and_django() -> None:
    about = reporting.machine()
    assert about["cpus"] >= 1
    assert about["python"].count(".") == 2
    assert about["django"] is not None
    assert {"postgres", "redis", "load_average", "cpu_model", "memory_gib", "platform"} <= about.keys()


def test_progress_prints_at_most_once_per_interval_with_the_count_and_time_left() -> None:
    clock, stream = FakeClock(), io.StringIO()
    shown = reporting.Progress("loading", total=100, unit="rows", every_s=5, stream=stream, clock=clock)
    clock.now += 1
    shown.update(10)
    assert stream.getvalue() == "", "a line within the first interval"
    clock.now += 4
    shown.update(25)
    clock.now += 1
    shown.advance(5)
    assert stream.getvalue().splitlines() == ["loading: 25/100 rows (25%), 5 s, ~15 s left"]
    clock.now += 4
    shown.advance(20)
    assert stream.getvalue().splitlines()[-1] == "loading: 50/100 rows (50%), 10 s, ~10 s left"


def test_progress_as_a_context_prints_a_first_and_a_last_line() -> None:
    clock, stream = FakeClock(), io.StringIO()
    with reporting.Progress("parking runs", total=2000, unit="runs", every_s=60, stream=stream, clock=clock) as shown:
        shown.advance(2000)
        clock.now += 3
    assert stream.getvalue().splitlines() == ["parking runs (2,000 runs) ...", "parking runs: 2,000 runs done in 3.0 s"]


def test_progress_says_a_phase_failed() -> None:
    clock, stream = FakeClock(), io.StringIO()
    with pytest.raises(RuntimeError), reporting.Progress("loading", every_s=60, stream=stream, clock=clock):
        raise RuntimeError("boom")
    assert stream.getvalue().splitlines()[-1] == "loading: failed after 0.0 s"


def test_progress_keeps_printing_while_nothing_updates_it() -> None:
    """The heartbeat: one long statement still shows a line (on the real clock, a short interval)."""
    stream = io.StringIO()
    with reporting.Progress("one long statement", every_s=0.05, stream=stream):
        deadline = time.monotonic() + 30
        while "one long statement: " not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("one long statement: ") and lines[1].endswith(" s"), lines
