"""SQLite's cross-process doorbell (`store/doorbell.py`): a ring reaches every listener of its
topic with its payload, once the ringing transaction committed; a dead listener's socket is
removed by the next ring and a listener that reads nothing never blocks a ringer.

"Another process" here is a listener's socket named with another pid: the one thing that tells
processes apart. The real cross-process wake-ups are in tests/processes/test_push_wakeups.py.
"""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from durable_flow.store import doorbell
from durable_flow.transports.db.transport import DatabaseTransport

pytestmark = [
    pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's doorbell: runs in the SQLite pass"),
    pytest.mark.django_db(transaction=True),
]

#: Generous: a verdict waits on a queue, never on a margin.
WAIT_S = 20.0


@pytest.fixture
def heard() -> Iterator[queue.Queue[bytes]]:
    """Payloads rung to a `runs` doorbell of this process."""
    payloads: queue.Queue[bytes] = queue.Queue()
    bell = doorbell.Doorbell(doorbell.RUNS, payloads.put)
    assert bell.start()
    yield payloads
    bell.stop()


def foreign_listener(topic: str) -> socket.socket:
    """A bound socket named as another process's listener of `topic` would be."""
    where = doorbell.folder()
    assert where is not None
    where.mkdir(exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(where / f"{topic}.{os.getpid() + 1}.test{id(sock)}.sock"))
    return sock


def test_a_ring_reaches_the_listener_with_its_payload(heard: queue.Queue[bytes]) -> None:
    assert doorbell.ring(doorbell.RUNS, b"run-1") == 1
    assert heard.get(timeout=WAIT_S) == b"run-1"


def test_a_dead_listeners_socket_is_removed_and_the_ring_still_reaches_the_live_one(
    heard: queue.Queue[bytes],
) -> None:
    dead = foreign_listener(doorbell.RUNS)
    path = dead.getsockname()
    dead.close()  # as a killed process leaves it: the file stays, nobody reads it
    assert os.path.exists(path)
    assert doorbell.ring(doorbell.RUNS, b"run-2") == 1
    assert not os.path.exists(path)
    assert heard.get(timeout=WAIT_S) == b"run-2"


def test_a_listener_that_reads_nothing_never_blocks_a_ringer() -> None:
    stuck = foreign_listener(doorbell.TASKS)
    try:
        # Far more datagrams than a socket buffers: once its buffer is full, rings are dropped.
        rung = [doorbell.ring(doorbell.TASKS) for _ in range(20_000)]
        assert rung[0] == 1
        assert 0 in rung
    finally:
        os.unlink(stuck.getsockname())
        stuck.close()


def test_an_enqueue_rings_the_other_processes_once_its_transaction_commits() -> None:
    other = foreign_listener(doorbell.TASKS)
    other.settimeout(WAIT_S)
    try:
        with transaction.atomic():
            DatabaseTransport().enqueue_turns(["run-a", "run-b"])
            DatabaseTransport().enqueue_step("run-a", "1", 1, priority=0)
            other.setblocking(False)
            with pytest.raises(BlockingIOError):
                other.recv(16)  # nothing before the commit
            other.settimeout(WAIT_S)
        assert other.recv(16) == b""  # the commit rang, once for the transaction
        other.setblocking(False)
        with pytest.raises(BlockingIOError):
            other.recv(16)
    finally:
        os.unlink(other.getsockname())
        other.close()


def test_a_rolled_back_enqueue_rings_nobody() -> None:
    other = foreign_listener(doorbell.TASKS)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            DatabaseTransport().enqueue_turns(["run-c"])
            raise RuntimeError("roll back")
        other.setblocking(False)
        with pytest.raises(BlockingIOError):
            other.recv(16)
    finally:
        os.unlink(other.getsockname())
        other.close()


def test_a_process_does_not_ring_its_own_task_doorbell() -> None:
    """Its own claimers are woken in-process; the doorbell is for the others."""
    own: queue.Queue[bytes] = queue.Queue()
    bell = doorbell.Doorbell(doorbell.TASKS, own.put)
    assert bell.start()
    try:
        with transaction.atomic():
            DatabaseTransport().enqueue_turns(["run-d"])
        doorbell.ring(doorbell.TASKS, b"after")  # datagrams arrive in order: this one comes first
        assert own.get(timeout=WAIT_S) == b"after"
    finally:
        bell.stop()
