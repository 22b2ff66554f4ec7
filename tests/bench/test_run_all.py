"""bench/run_all.py builds its summary and charts from the benches' JSON documents, and carries
on past a bench that fails or writes none; every bench takes `--json PATH`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import plots
import pytest
import run_all

from tests.bench.conftest import BENCH

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "reports.json"
SCRIPTS = sorted(path.name for path in BENCH.glob("*.py") if path.name not in run_all.HELPERS)


def fixture_reports() -> dict[str, dict[str, Any]]:
    return json.loads(FIXTURE.read_text())


def fake_bench(tmp_path: Path, body: str) -> Path:
    """A bench script in `tmp_path` that takes `--json PATH` as the real ones do."""
    script = tmp_path / "fake_bench.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import argparse, sys
            sys.path.insert(0, {str(BENCH)!r})
            import reporting
            parser = argparse.ArgumentParser()
            reporting.add_json_option(parser, "fake")
            args = parser.parse_args()
            """
        )
        + textwrap.dedent(body)
    )
    return script


def test_every_bench_script_takes_a_json_path() -> None:
    """Each bench imports cleanly and offers `--json PATH` (run_all.py passes it to every bench)."""

    def helped(script: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(BENCH / script), "--help"]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=BENCH.parent, check=False)

    with ThreadPoolExecutor(4) as pool:
        answers = dict(zip(SCRIPTS, pool.map(helped, SCRIPTS), strict=True))
    failed = {script: done.stderr[-300:] for script, done in answers.items() if done.returncode != 0}
    assert not failed
    assert [script for script, done in answers.items() if "--json PATH" not in done.stdout] == []
    assert len(SCRIPTS) >= 20


def test_the_plan_runs_every_bench_script_and_no_helper() -> None:
    planned = {argv[0] for _, argv in run_all.plan(quick=True, only=None)}
    assert planned == set(SCRIPTS)


def test_a_run_name_becomes_a_file_name() -> None:
    assert run_all.slug("poller (SQLite)") == "poller-sqlite"
    assert run_all.slug("start_control") == "start_control"


def test_the_summary_is_each_reports_summary_and_its_missed_targets() -> None:
    reports = fixture_reports()
    result = run_all.Result("transport", ["transport.py"], 1.0, 0, "printed", report=reports["transport"])
    assert run_all.headlines(result) == [
        "1 process(es): raw RQ 225 jobs/s; over rq 247 wf/s (ratio 1.10, worst round 0.99)",
        "**MISSED** over rq / raw RQ at 4 process(es), median of the rounds: 0.275 (target >= 0.5)",
        "targets met: 0 of 1",
    ]


def test_the_page_carries_every_bench_and_a_failed_one_as_failed() -> None:
    reports = fixture_reports()
    results = [
        run_all.Result(name, [f"{doc['bench']}.py"], 2.0, 0, f"{name} printed", report=doc)
        for name, doc in reports.items()
    ]
    results.append(run_all.Result("broken", ["broken.py"], 1.0, 1, "", errors="Traceback", problem="exit 1: boom"))
    text = run_all.page(results, reports["rss"]["machine"], True, {}, "2026-12-07 12:00 UTC", [])
    assert (
        "| `rss.py` | 2 s | ratio last / first quarter: 1.010 (target <= 1.10: flat)<br>targets met: 1 of 1 |" in text
    )
    assert "| `broken.py` | 1 s | **failed**: exit 1: boom |" in text
    assert "Test CPU, 2 CPUs, 8.0 GiB RAM" in text
    assert "--json PATH" in text, "the page says how the figures are written"


def test_the_charts_are_drawn_from_the_reports_figures(tmp_path: Path) -> None:
    written, unread = plots.render(fixture_reports(), tmp_path)
    assert unread == []
    assert set(written) == set(plots.CHARTS)
    assert all((tmp_path / name).stat().st_size > 1000 for name in written)


def test_a_chart_whose_figures_changed_is_reported_not_drawn(tmp_path: Path) -> None:
    reports = fixture_reports()
    del reports["rss"]["figures"]["tenths_mib"]
    written, unread = plots.render({"rss": reports["rss"]}, tmp_path)
    assert written == {}
    assert len(unread) == 1 and unread[0].startswith("rss.png not drawn")


def test_a_bench_that_writes_its_report_is_read(tmp_path: Path) -> None:
    script = fake_bench(
        tmp_path,
        """\
        print("ratio 0.5")
        reporting.write_json("fake", {"ratio": 0.5}, path=args.json, summary=["ratio 0.5"],
                             targets=[reporting.target("ratio", 0.5, ">=", 0.9)], about={})
        """,
    )
    result = run_all.run("fake (one)", [str(script)], directory=tmp_path / "run")
    assert not result.failed, result.problem
    assert result.output == "ratio 0.5"
    assert result.report is not None and result.report["figures"] == {"ratio": 0.5}
    assert (tmp_path / "run" / "fake-one.json").exists()
    assert run_all.headlines(result) == ["ratio 0.5", "**MISSED** ratio: 0.5 (target >= 0.9)", "targets met: 0 of 1"]


def test_a_failing_bench_is_reported_with_its_error(tmp_path: Path) -> None:
    script = fake_bench(tmp_path, 'print("half way")\nraise SystemExit("the database went away")\n')
    result = run_all.run("fake", [str(script)], directory=tmp_path)
    assert result.failed
    assert result.problem == "exit 1: the database went away"
    assert result.output == "half way"
    assert run_all.headlines(result) == ["**failed**: exit 1: the database went away"]


def test_a_bench_that_writes_no_report_is_a_failure(tmp_path: Path) -> None:
    script = fake_bench(tmp_path, 'print("ratio 0.5")\n')
    result = run_all.run("fake", [str(script)], directory=tmp_path)
    assert result.returncode == 0
    assert result.failed
    assert result.problem.startswith("wrote no JSON to fake.json")


def test_a_bench_past_its_timeout_is_stopped_and_reported(tmp_path: Path) -> None:
    script = fake_bench(tmp_path, "import time\ntime.sleep(300)\n")
    result = run_all.run("fake", [str(script)], directory=tmp_path, timeout_s=1)
    assert result.failed
    assert result.problem == "timed out after 1 s"
    assert result.seconds < 120


def test_a_stale_report_of_an_earlier_run_is_never_read(tmp_path: Path) -> None:
    (tmp_path / "fake.json").write_text(FIXTURE.read_text())
    script = fake_bench(tmp_path, "")
    assert run_all.run("fake", [str(script)], directory=tmp_path).report is None


@pytest.mark.timeout(120)
def test_a_real_bench_writes_a_report_run_all_reads(tmp_path: Path) -> None:
    """bench/fairness.py (seconds on SQLite and the in-process backend) through run_all.run."""
    result = run_all.run("fairness", ["fairness.py", "--no-redis", "--cycles", "5", "--admissions", "20"], tmp_path)
    assert not result.failed, result.problem
    assert result.report is not None
    assert set(result.report["figures"]["backends"]) == {"local", "db (SQLite)"}
    assert [entry["met"] for entry in result.report["targets"]] == [True, True]
    assert "Jain" in run_all.headlines(result)[0]


def test_only_keeps_the_last_runs_other_rows_in_order_and_dates_the_fresh_ones() -> None:
    def row(name: str, when: str) -> run_all.Result:
        return run_all.Result(name, [f"{name}.py"], 1.0, 0, "", when=when)

    kept = [row("poller (SQLite)", "old"), row("transport", "old"), row("contention", "old")]
    rows = run_all.merged(kept, [row("contention", "new"), row("transport", "new")])
    assert [(r.name, r.when) for r in rows] == [("poller (SQLite)", "old"), ("transport", "new"), ("contention", "new")]
    reports = fixture_reports()
    page = run_all.page(rows, reports["rss"]["machine"], True, {}, "old", [])
    assert "| `transport.py` | 1 s<br>new |" in page and "| `poller (SQLite).py` | 1 s |" in page
    assert "gives its date beside its time" in page


def test_the_notes_written_by_hand_sit_between_the_table_and_the_outputs() -> None:
    reports = fixture_reports()
    result = run_all.Result("rss", ["rss.py"], 2.0, 0, "rss printed", report=reports["rss"])
    text = run_all.page([result], reports["rss"]["machine"], True, {}, "now", [], notes="### Retention\n\nA million.\n")
    assert text.index("| `rss.py`") < text.index("### Retention") < text.index("## Full outputs")
    assert (run_all.BENCH / "notes.md").exists(), "the page's hand-written sections live in bench/notes.md"


def test_the_rq_claim_bench_runs_through_the_transports_own_enqueue(tmp_path: Path) -> None:
    """A short run of bench/rq_claim.py (its own redis-server): it once called a private method
    of the transport whose signature had changed, and failed in every run_all."""
    path = tmp_path / "rq_claim.json"
    command = [sys.executable, str(BENCH / "rq_claim.py"), "--idle-s", "1", "--jobs", "50", "--json", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCH.parent, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(path.read_text())
    assert report["figures"]["drain"]["jobs"] == 50 and len(report["figures"]["wake"]["claim_ms"]) == 50
