"""The soak's verdicts on hand-made evidence: each check must catch what it is there to catch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.evidence import (
    OUTAGE_LEAD_S,
    OUTAGE_REACH_S,
    Kill,
    Outage,
    busiest_window,
    max_overlap,
    open_at,
    over_limit,
    read_evidence,
)


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_a_re_execution_is_explained_only_by_a_kill_of_a_process_that_ran_the_step(tmp_path: Path) -> None:
    log = write_log(
        tmp_path / "log",
        ["start r1 1 100 1.0", "start r1 1 200 2.0", "end r1 1 200 2.5", "start r2 1 200 3.0", "end r2 1 200 3.1"],
    )
    assert read_evidence(log, [Kill(pid=100, at=1.5, role="worker")]).unexplained_reexecutions() == []
    with pytest.raises(AssertionError, match="never ended"):
        read_evidence(log, []).intervals(1)


def test_two_survivors_running_one_step_is_unexplained(tmp_path: Path) -> None:
    log = write_log(
        tmp_path / "log", ["start r1 2 100 1.0", "end r1 2 100 1.1", "start r1 2 200 2.0", "end r1 2 200 2.1"]
    )
    evidence = read_evidence(log, [Kill(pid=300, at=1.5, role="worker")])
    assert evidence.unexplained_reexecutions() == [("r1", 2)]
    assert evidence.reexecutions() == 1


def test_a_re_execution_is_explained_by_an_outage_only_within_its_reach(tmp_path: Path) -> None:
    reach = OUTAGE_REACH_S
    near = write_log(tmp_path / "near", ["start r1 1 100 50.0", "end r1 1 100 50.1", "start r1 1 100 90.0"])
    far = write_log(tmp_path / "far", [f"start r1 1 100 {50 + reach + 1}", "end r1 1 100 99.0", "start r1 1 100 100"])
    outage = [Outage("redis", 40.0, 50.0 - reach / 2)]
    assert read_evidence(near, [], outage).unexplained_reexecutions() == []
    assert read_evidence(near, [], outage).outage_reexecutions() == 1
    assert read_evidence(near, []).unexplained_reexecutions() == [("r1", 1)]
    assert read_evidence(far, [], outage).unexplained_reexecutions() == [("r1", 1)]


def test_a_re_execution_is_explained_by_a_database_outage_that_began_while_its_result_was_recorded(
    tmp_path: Path,
) -> None:
    # The step returned 7 ms before PostgreSQL went down: its result was being recorded then.
    lead = OUTAGE_LEAD_S
    log = write_log(tmp_path / "log", ["start r1 1 100 50.0", "end r1 1 100 50.03", "start r1 1 100 80.0"])
    assert read_evidence(log, [], [Outage("postgresql", 50.037, 53.0)]).unexplained_reexecutions() == []
    too_early = [Outage("postgresql", 50.03 + lead + 1, 60.0)]
    assert read_evidence(log, [], too_early).unexplained_reexecutions() == [("r1", 1)]


def test_a_redis_outage_that_began_after_a_step_returned_does_not_explain_its_re_execution(tmp_path: Path) -> None:
    # Recording a result needs only the database: Redis going down 7 ms later cannot lose it.
    log = write_log(tmp_path / "log", ["start r1 1 100 50.0", "end r1 1 100 50.03", "start r1 1 100 80.0"])
    assert read_evidence(log, [], [Outage("redis", 50.037, 53.0)]).unexplained_reexecutions() == [("r1", 1)]


def test_an_execution_cut_by_a_kill_overlaps_until_the_kill(tmp_path: Path) -> None:
    log = write_log(tmp_path / "log", ["start a 1 100 1.0", "start b 1 200 2.0", "end b 1 200 3.0"])
    killed_late = read_evidence(log, [Kill(pid=100, at=2.5, role="worker")])
    killed_early = read_evidence(log, [Kill(pid=100, at=1.5, role="worker")])
    assert max_overlap(killed_late.intervals(1)) == 2
    assert max_overlap(killed_early.intervals(1)) == 1


def test_back_to_back_executions_do_not_overlap() -> None:
    assert max_overlap([(1.0, 2.0), (2.0, 3.0)]) == 1


def test_the_busiest_window_counts_a_half_open_span() -> None:
    times = [100.0, 100.1, 100.7, 101.0, 101.1]
    assert busiest_window(times, 0.75) == 3  # 100.0, 100.1, 100.7
    assert busiest_window(times, 0.95) == 3  # [100.0, 100.95) and [100.1, 101.05) hold three each
    assert busiest_window(times, 1.05) == 4


def test_over_limit_names_each_instant_the_open_intervals_rise_above_the_limit() -> None:
    spans = [(1.0, 3.0), (2.0, 4.0), (2.5, 2.6), (3.0, 5.0)]
    # At 2.5 three are open; at 3.0 the first ends before the fourth starts: two, then three.
    assert over_limit(spans, 2) == [(2.5, 3)]
    assert over_limit(spans, 3) == []
    assert open_at(spans, 2.55) == 3 and open_at(spans, 4.5) == 1


def test_spans_of_some_runs_cover_every_stage_and_end_a_killed_execution_at_its_kill(tmp_path: Path) -> None:
    log = write_log(
        tmp_path / "log",
        ["start r1 1 100 1.0", "end r1 1 100 1.5", "start r1 2 200 2.0", "start r2 1 100 2.0", "end r2 1 100 2.2"],
    )
    evidence = read_evidence(log, [Kill(pid=200, at=2.7, role="host h1")])
    assert sorted(evidence.spans({"r1"})) == [(1.0, 1.5), (2.0, 2.7)]
    assert len(evidence.spans()) == 3
