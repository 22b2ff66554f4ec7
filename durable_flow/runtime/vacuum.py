"""The poller's vacuum of the hot tables (PostgreSQL): only when needed, never too often, and
off the poller's thread.

A queued workflow leaves dead rows in a few tables (`durable_flow.store.maintenance`); left
alone, their dead index entries slow every claim and turn. PostgreSQL's autovacuum cleans them
when it is on and gets round to it; a server with `autovacuum = off`, or a busy queue between
two of autovacuum's passes, lets them pile up. So on each maintenance pass the poller reads the
hot tables' dead and live rows from the statistics (one cheap read) and, when a table's dead
rows pass `VACUUM_DEAD_ROWS` plus `VACUUM_DEAD_FRACTION` of its live rows and the table was not
vacuumed by this poller in the last `VACUUM_MIN_INTERVAL_S`, vacuums it, the one with the most
dead rows first, one at a time, on a thread of its own: the tick goes on waking runs meanwhile.
With several pollers each may vacuum a table; PostgreSQL lets only one VACUUM work on a table
at a time and the other waits its turn, then finds little to do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.db import connection

from durable_flow.store import maintenance
from durable_flow.store.maintenance import TableHealth

logger = logging.getLogger("durable_flow.runtime.vacuum")


@dataclass(frozen=True, slots=True)
class VacuumPolicy:
    """When a table needs a vacuum: `dead > dead_rows + dead_fraction * live`, at most once per
    `min_interval_s` a table. `dead_rows` None: never (the off switch)."""

    dead_rows: int | None
    dead_fraction: float
    min_interval_s: float

    def choose(self, health: Sequence[TableHealth], last: dict[str, float], now: float) -> TableHealth | None:
        """The table to vacuum now, or None: of those past the threshold and not vacuumed
        within the interval, the one with the most dead rows.

        >>> policy = VacuumPolicy(dead_rows=1000, dead_fraction=0.1, min_interval_s=30)
        >>> policy.choose([TableHealth("t", dead=1200, live=1000)], {}, now=0).table
        't'
        >>> policy.choose([TableHealth("t", dead=1200, live=1000)], {"t": -10.0}, now=0) is None
        True
        """
        if self.dead_rows is None:
            return None
        due = [
            table
            for table in health
            if table.dead > self.dead_rows + self.dead_fraction * table.live
            and now - last.get(table.table, float("-inf")) >= self.min_interval_s
        ]
        return max(due, key=lambda table: table.dead, default=None)


class Vacuums:
    """The poller's vacuums: decides on each maintenance pass, runs one vacuum at a time on a
    thread of its own, and logs each (table, dead and live rows before, how long it took)."""

    def __init__(self, policy: VacuumPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        #: When (the clock's reading) this poller last started a vacuum of each table.
        self.last: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        #: How many vacuums this poller ran to the end, and how many failed.
        self.done = 0
        self.failed = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_vacuum(self) -> str | None:
        """Start a vacuum of the table that needs one most, unless one runs already; return
        its name, or None. A no-op but on PostgreSQL, and when `VACUUM_DEAD_ROWS` is None."""
        if self.policy.dead_rows is None or self.running or not maintenance.can_vacuum():
            return None
        now = self.clock()
        chosen = self.policy.choose(maintenance.hot_table_health(), self.last, now)
        if chosen is None:
            return None
        self.last[chosen.table] = now
        self._thread = threading.Thread(
            target=self._vacuum, args=(chosen,), name=f"durable_flow-vacuum-{chosen.table}", daemon=True
        )
        self._thread.start()
        return chosen.table

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running vacuum to end (tests, a stopping poller); False if it still runs."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.running

    def _vacuum(self, table: TableHealth) -> None:
        started = time.monotonic()
        try:
            maintenance.vacuum(table.table)
        except Exception:
            self.failed += 1
            logger.exception("vacuum of %s failed", table.table)
        else:
            self.done += 1
            logger.info(
                "vacuumed %s: %d dead rows beside %d live, in %.2f s",
                table.table,
                table.dead,
                table.live,
                time.monotonic() - started,
            )
        finally:
            connection.close()  # this thread's own connection
