"""A cross-process doorbell for SQLite, which has no `LISTEN`/`NOTIFY`: a Unix datagram socket
per listening process, in a folder next to the database file.

A process that waits for something other processes commit (a worker's idle claimer for new
tasks, a caller waiting for a run's result) binds a socket named after what it waits for (its
topic) in that folder; a process that commits such a thing sends one datagram to each socket of
the topic once the transaction committed (`ring`). Why datagram sockets, and not the others the
operating system gives:

* a datagram needs no connection and no open per ring: one non-blocking `sendto` per listener,
  which never blocks the committer (a listener whose buffer is full has bells waiting already:
  the datagram is dropped, and nothing is lost);
* a dead listener is told apart at once: its socket file refuses the datagram
  (`ConnectionRefusedError`), and the ringer removes it;
* a FIFO would need an open per ring and per listener (a FIFO with many readers wakes only one
  of them), and an `open` of a dead reader's FIFO fails only in non-blocking mode;
* `inotify` on the database's WAL file fires on every write, reads' checkpoints included, and
  is Linux's alone; Unix sockets are on every POSIX system Django runs on.

The bell only says "look now": what to do is read from the database, as the poll would have,
so a lost bell (a listener restarting, a full buffer) costs one poll interval, never a task or a
result. Where no socket can be made (an in-memory database, no Unix sockets, a read-only
folder) nothing rings and the polls carry on alone.

A socket's path must fit `sun_path` (104 bytes on macOS, 108 on Linux): when the folder next to
the database is too deep, every process uses one under the system's temporary folder named
after the database's absolute path instead, so they still agree.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from functools import cache
from pathlib import Path

from django.db import connections

logger = logging.getLogger("durable_flow.store.doorbell")

#: Topics: new task rows (the `db` transport's claimers), finished runs (callers' waits), runs
#: parked until soon (the timer poller, `store.timer_bells`).
TASKS = "tasks"
RUNS = "runs"
TIMERS = "timers"
#: The longest socket path every platform takes (`sun_path` is 104 bytes on macOS).
MAX_SOCKET_PATH = 100
#: How long a listener blocks in `recv` before it looks at its stop flag again.
RECV_TIMEOUT_S = 1.0
#: The longest datagram a listener reads (a run id fits with room to spare).
MAX_DATAGRAM = 512

_sender_lock = threading.Lock()
_sender: socket.socket | None = None


def available() -> bool:
    """Whether this platform has Unix sockets."""
    return hasattr(socket, "AF_UNIX")


@cache
def _folder_for(database: str) -> Path:
    path = Path(database).resolve()
    folder = path.with_name(f"{path.name}.doorbells")
    if len(str(folder)) + 60 > MAX_SOCKET_PATH:  # room for the longest socket name
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:20]
        folder = Path(tempfile.gettempdir()) / f"durable_flow-{digest}.doorbells"
    return folder


def folder(alias: str = "default") -> Path | None:
    """The doorbells' folder of the SQLite database `alias` opens; None for another database,
    an in-memory one, or a platform without Unix sockets."""
    settings = connections[alias].settings_dict
    if connections[alias].vendor != "sqlite" or not available():
        return None
    name = str(settings.get("NAME") or "")
    if not name or name == ":memory:" or name.startswith("file:") or "mode=memory" in name:
        return None
    return _folder_for(name)


def _send_socket() -> socket.socket:
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sender.setblocking(False)
        return _sender


def ring(topic: str, payload: bytes = b"", *, alias: str = "default", others_only: bool = False) -> int:
    """Send `payload` to every listener of `topic` (`others_only`: not this process's own);
    returns how many took it. Never blocks and never raises: a dead listener's socket is
    removed, a full one skipped (it has bells waiting), any other failure logged at debug."""
    where = folder(alias)
    if where is None:
        return 0
    prefix = f"{topic}."
    own = f"{topic}.{os.getpid()}."
    try:
        names = [entry.name for entry in os.scandir(where) if entry.name.startswith(prefix)]
    except FileNotFoundError:
        return 0  # nobody ever listened
    except OSError:
        logger.debug("cannot list the doorbells in %s", where, exc_info=True)
        return 0
    sender = _send_socket()
    rung = 0
    for name in names:
        if others_only and name.startswith(own):
            continue
        path = str(where / name)
        try:
            sender.sendto(payload, path)
            rung += 1
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its process died without removing it
        except BlockingIOError:
            pass  # its buffer is full: it has bells waiting already
        except OSError:
            logger.debug("ringing %s failed", path, exc_info=True)
    return rung


class Doorbell:
    """A daemon thread that binds this process's socket for `topic` and calls `on_ring` with
    each datagram's payload; its socket is removed on `stop` (and by the next ringer if the
    process dies). Start it before reading what it watches: a commit between the read and the
    bind would ring nobody."""

    def __init__(self, topic: str, on_ring: Callable[[bytes], None], alias: str = "default") -> None:
        self._topic = topic
        self._on_ring = on_ring
        self._alias = alias
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.path: Path | None = None
        self.listening = threading.Event()  # set once the socket is bound

    def start(self) -> bool:
        """Bind and start listening; False (and nothing started) where no doorbell can be made."""
        if self._thread is not None:
            return True
        where = folder(self._alias)
        if where is None:
            return False
        path = where / f"{self._topic}.{os.getpid()}.{uuid.uuid4().hex[:12]}.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            where.mkdir(mode=0o700, exist_ok=True)
            sock.bind(str(path))
        except OSError:
            sock.close()
            logger.warning("no doorbell in %s: waiting by polling alone", where, exc_info=True)
            return False
        sock.settimeout(RECV_TIMEOUT_S)
        self._socket, self.path = sock, path
        self._stop.clear()
        atexit.register(self._close)  # a process that exits without `stop` leaves no socket behind
        self.listening.set()
        self._thread = threading.Thread(target=self._loop, name=f"df-doorbell-{self._topic}", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = RECV_TIMEOUT_S * 3) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._close()

    def _close(self) -> None:
        atexit.unregister(self._close)
        self._stop.set()  # at exit too: the thread's `recv` fails on the closed socket, quietly
        self.listening.clear()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None

    def _loop(self) -> None:
        sock = self._socket
        assert sock is not None
        while not self._stop.is_set():
            try:
                payload = sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                if not self._stop.is_set():
                    logger.warning("the %s doorbell failed: waiting by polling alone", self._topic, exc_info=True)
                return
            try:
                self._on_ring(payload)
            except Exception:  # a bell's receiver must not end the thread
                logger.exception("a %s doorbell's receiver failed", self._topic)
