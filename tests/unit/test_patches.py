"""`ctx.patched`: a changed workflow deployed under in-flight runs. A run already past the change
keeps the old path, a run before it and a new run take the new one, each run's answer holds on
every later turn, and `patch_states` tells when the old branch can go."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from durable_flow import NonDeterminismError, send_signal, start
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidInput
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, WorkflowRun
from durable_flow.observe.patches import patch_states
from durable_flow.observe.timeline import build_timeline
from tests import patched_workflows
from tests.patched_workflows import PATCH_ID

WORKFLOW = "tests.patched_flow"


def _status(run_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run_id)


def _deploy(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setenv("DURABLE_FLOW_TEST_PATCH", code)


def _in_flight(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Under the old code: one run past the change (waiting for `finish`), one before it
    (waiting for `go`)."""
    _deploy(monkeypatch, "old")
    past = start(WORKFLOW, 1, run_id="past").id
    before = start(WORKFLOW, 10, run_id="before").id
    send_signal(past, "go")
    assert StepCheckpoint.objects.filter(run_id=past, key="3", name="tests.add_one").exists()
    assert not StepCheckpoint.objects.filter(run_id=before, key="3").exists()
    return past, before


def test_a_run_past_the_change_keeps_the_old_path_and_the_others_take_the_new_one(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    past, before = _in_flight(monkeypatch)
    _deploy(monkeypatch, "patched")
    new = start(WORKFLOW, 100, run_id="new").id
    for run_id in (past, before, new):
        send_signal(run_id, "go")
    for run_id in (past, before, new):
        send_signal(run_id, "finish")

    assert _status(past).output == {"path": "old", "second": 3}  # add_one(add_one(1))
    assert _status(before).output == {"path": "new", "second": 22}  # double(add_one(10))
    assert _status(new).output == {"path": "new", "second": 202}
    markers = dict(StepCheckpoint.objects.filter(kind=StepKind.PATCH).values_list("run_id", "output"))
    assert markers == {past: False, before: True, new: True}
    # The marker takes no call position: the calls after it keep the keys the old code gave them.
    assert StepCheckpoint.objects.get(run_id=before, key=f"patch:{PATCH_ID}").kind == StepKind.PATCH
    assert sorted(StepCheckpoint.objects.filter(run_id=before).values_list("key", flat=True)) == [
        "1",
        "2",
        "3",
        "4",
        f"patch:{PATCH_ID}",
    ]


def test_the_recorded_answer_holds_on_every_later_turn(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _deploy(monkeypatch, "patched")
    run_id = start(WORKFLOW, 1).id
    send_signal(run_id, "go")  # reaches the change fresh: the new path, recorded
    # Replayed again (the `finish` signal's turn), with the second step recorded after the marker:
    # the marker answers, not the later checkpoints.
    send_signal(run_id, "finish")
    run = _status(run_id)
    assert run.status == RunStatus.COMPLETED and run.output == {"path": "new", "second": 4}
    assert StepCheckpoint.objects.filter(run_id=run_id, kind=StepKind.PATCH).count() == 1
    # The run's timeline draws its calls; the marker is a decision, not a bar.
    assert [row.key for row in build_timeline(run).rows if row.kind != "turn"] == ["1", "2", "3", "4"]


def test_the_same_change_without_patched_fails_a_run_past_it(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `ctx.patched` prevents: the new code alone replays an old run's history wrongly."""
    past, before = _in_flight(monkeypatch)
    _deploy(monkeypatch, "removed")
    send_signal(past, "finish")
    send_signal(before, "go")
    send_signal(before, "finish")
    assert _status(past).status == RunStatus.FAILED
    assert _status(past).error["type"].endswith(NonDeterminismError.__name__)
    assert _status(before).output == {"path": "new", "second": 22}


def test_the_check_says_removable_once_the_old_path_runs_are_finished(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    past, before = _in_flight(monkeypatch)
    _deploy(monkeypatch, "patched")
    new = start(WORKFLOW, 100).id
    send_signal(new, "go")  # the first run to take the new path: the deploy's time by default
    (state,) = patch_states(WORKFLOW)
    # `past` and `before` predate it and have not reached the call under the new code.
    assert (state.new_path, state.old_path, state.unmarked, state.removable) == (1, 0, 2, False)
    assert state.run_ids == (before, past)

    engine.run_turn(past)  # a turn of the new code: takes (and records) the old path, waits on
    send_signal(before, "go")
    (state,) = patch_states(WORKFLOW, PATCH_ID)
    assert (state.new_path, state.old_path, state.unmarked) == (2, 1, 0)
    assert state.run_ids == (past,)
    with pytest.raises(CommandError, match="still has runs"):
        call_command("durable_patches", "--patch", PATCH_ID)

    send_signal(past, "finish")
    assert _status(past).output == {"path": "old", "second": 3}
    (state,) = patch_states(WORKFLOW, PATCH_ID)
    assert state.removable
    call_command("durable_patches", "--patch", PATCH_ID)  # exits 0

    # Removed: the runs in flight, and a new one, finish on the new path.
    _deploy(monkeypatch, "removed")
    later = start(WORKFLOW, 1000).id
    for run_id in (before, new, later):
        send_signal(run_id, "go")
        send_signal(run_id, "finish")
    assert [_status(r).output["path"] for r in (before, new, later)] == ["new", "new", "new"]
    assert all(_status(r).status == RunStatus.COMPLETED for r in (before, new, later))


def test_the_check_refuses_a_change_no_run_reached(engine: Engine) -> None:
    assert patch_states(WORKFLOW) == []
    with pytest.raises(CommandError, match="no run has reached change 'nope'"):
        call_command("durable_patches", "--patch", "nope")
    with pytest.raises(CommandError, match="--deployed-at"):
        call_command("durable_patches", "--deployed-at", "yesterday")


def test_a_bad_patch_id_fails_the_run_with_invalid_input(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert patched_workflows.CODES  # the module is registered by this import
    from durable_flow import workflow

    @workflow("tests.bad_patch_id")
    def bad(ctx: object, _: object) -> bool:
        return ctx.patched("x" * 200)  # type: ignore[attr-defined]

    run = start("tests.bad_patch_id")
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"].endswith(InvalidInput.__name__)


def test_a_patched_call_before_the_first_call_takes_the_new_path(engine: Engine) -> None:
    # On the `db` pair the first turn's probe stops at the marker (it writes nothing) and the
    # locked path records it.
    run = start("tests.patched_first", 4)
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, 8)
    assert StepCheckpoint.objects.get(run=run, kind=StepKind.PATCH).output is True
    assert StepCheckpoint.objects.get(run=run, key="1").name == "tests.double"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="a plan of PostgreSQL's")
def test_postgresql_finds_a_change_s_markers_from_their_own_index(transactional_db: None) -> None:
    markers = StepCheckpoint.objects.filter(kind=StepKind.PATCH, name=PATCH_ID, run__workflow=WORKFLOW)
    sql, params = markers.values("run_id").query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        try:
            cursor.execute(f"EXPLAIN {sql}", params)
            text = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET enable_seqscan")
    assert "df_checkpoint_patch" in text, text
