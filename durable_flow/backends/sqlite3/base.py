"""Django's SQLite backend, its write transactions queued across processes on a file lock.

SQLite lets one writer in at a time. With `transaction_mode: IMMEDIATE` every
`transaction.atomic()` takes the write lock at `BEGIN`, and a connection that finds it taken
waits in SQLite's busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries: a
waiter that just missed a release sleeps through several short transactions, and the more
processes share the file, the more of them sleep at once: on the embedded default, two and four
worker processes ran slower than one (`bench/sqlite_processes.py`; see docs/benchmark-history.md).

Here a connection takes an exclusive `flock` on a lock file beside the database before its
`BEGIN` and lets it go at `COMMIT` or `ROLLBACK` (or when the connection closes): writers wait
in the kernel, which wakes one the moment the lock is free, instead of sleeping in the busy
handler. The lock is the kernel's, so a process that dies holding it releases it; each
connection opens the file itself, so threads of one process queue on it as processes do.
Statements outside `atomic()` (autocommit) do not take it: they still meet SQLite's own lock
and its busy handler, as before. An in-memory database takes no lock.

Use it as the `ENGINE` of a SQLite database: `"ENGINE": "durable_flow.backends.sqlite3"`
(the project's settings do, `settings/base.py`).
"""

from __future__ import annotations

import fcntl
import os

from django.db.backends.sqlite3 import base


class DatabaseWrapper(base.DatabaseWrapper):
    """`django.db.backends.sqlite3`, with `atomic()` blocks queued on `<NAME>-writelock`."""

    _lock_fd: int | None = None
    _holding: bool = False

    def _take_write_lock(self) -> None:
        if self.is_in_memory_db():
            return
        if self._lock_fd is None:
            self._lock_fd = os.open(f"{self.settings_dict['NAME']}-writelock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # blocks with the GIL released
        self._holding = True

    def _let_go(self) -> None:
        if self._holding and self._lock_fd is not None:
            self._holding = False
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _start_transaction_under_autocommit(self) -> None:
        self._take_write_lock()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._let_go()
            raise

    def _commit(self) -> None:
        try:
            super()._commit()
        finally:
            self._let_go()

    def _rollback(self) -> None:
        try:
            super()._rollback()
        finally:
            self._let_go()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._let_go()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
