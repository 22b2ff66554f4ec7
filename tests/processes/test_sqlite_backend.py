"""`durable_flow.backends.sqlite3`: every `atomic()` block on a SQLite file holds an exclusive
`flock` on `<NAME>-writelock` from its `BEGIN` to its `COMMIT` or `ROLLBACK`, so writers of
every process queue in the kernel instead of sleeping in SQLite's busy handler. Run in the
SQLite pass (the project's settings use this backend for every SQLite database)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.db import connection, transaction

from durable_flow.models import WorkflowRun

pytestmark = [
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite backend: the SQLite pass"),
    pytest.mark.django_db(transaction=True),
]


def lock_file() -> Path:
    return Path(f"{connection.settings_dict['NAME']}-writelock")


@contextmanager
def another_descriptor() -> Iterator[int]:
    """The lock file opened apart (a `flock` on another open file conflicts with this one's,
    in this process too)."""
    fd = os.open(lock_file(), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def is_free() -> bool:
    with another_descriptor() as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True


def test_the_backend_is_the_projects_sqlite_engine() -> None:
    assert connection.settings_dict["ENGINE"] == "durable_flow.backends.sqlite3"
    assert connection.vendor == "sqlite"


def test_an_atomic_block_holds_the_lock_until_it_commits_or_rolls_back() -> None:
    WorkflowRun.objects.count()  # connected, outside any transaction: no lock held
    assert is_free()
    with transaction.atomic():
        WorkflowRun.objects.create(id="held", workflow="tests.hello")
        assert not is_free()
        with transaction.atomic():  # a savepoint: the outer block still holds it
            assert not is_free()
        assert not is_free()
    assert is_free() and WorkflowRun.objects.filter(id="held").exists()

    with pytest.raises(RuntimeError), transaction.atomic():
        WorkflowRun.objects.create(id="rolled-back", workflow="tests.hello")
        assert not is_free()
        raise RuntimeError("roll it back")
    assert is_free() and not WorkflowRun.objects.filter(id="rolled-back").exists()


def test_a_write_waits_for_another_process_holding_the_lock_and_goes_on_when_it_lets_go() -> None:
    WorkflowRun.objects.count()  # the test database exists, and with it the lock's directory
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()",
            str(lock_file()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    entered = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        from django.db import connections

        try:
            with transaction.atomic():
                entered.set()
                WorkflowRun.objects.create(id="after-the-holder", workflow="tests.hello")
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            connections.close_all()

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        writer = threading.Thread(target=write)
        writer.start()
        # While the other process holds the lock the writer cannot have begun. (A slow machine
        # only makes this wait longer: nothing here can pass early.)
        assert not entered.wait(0.5)
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(60)
        assert entered.is_set() and not writer.is_alive() and not errors
    finally:
        holder.kill()
        holder.wait()
    assert WorkflowRun.objects.filter(id="after-the-holder").exists()
