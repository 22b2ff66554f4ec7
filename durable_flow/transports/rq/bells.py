"""An idle worker's wait on the doorbells of lanes on several Redis servers.

One `BLPOP` names keys of one server only. On one server the claiming thread blocks on every
lane's doorbell itself (`ClaimBook.wait` for one lane). Across servers a listener thread per
server blocks there instead, and hands the bell it took to the claiming thread through this
object: the claimer waits on one `threading.Event` that any listener sets, so a job enqueued on
any server wakes an idle worker at once, with nothing polling in between (each listener is
parked in Redis, the claimer on the event; the claimer's own wait still ends at the runtime's
idle timeout, as on one server, to find jobs pushed without a bell).

A listener takes one bell, then waits until the claimer has counted it (`take`) before it
listens again: the pop that follows passes that bell on (`bells_taken`), so the bells still
track the queued jobs, and a listener never drains bells meant for other workers. A listener
whose server is down backs off (`Outage`'s schedule) and tries again; the others keep serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from durable_flow.store.outage import Outage, transient_errors
from durable_flow.transports.rq.lanes import Lane, Server, describe

logger = logging.getLogger("durable_flow.transports.rq")

#: How long one listener's `BLPOP` blocks before it looks at its stop flag again. It bounds how
#: long a stopped worker's listener lingers (a daemon thread), not how soon a bell is seen.
LISTEN_S = 2.0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Doorbells:
    """The bells of every lane, heard by one listener thread per Redis server."""

    def __init__(self, servers: dict[Server, Sequence[Lane]], listen_s: float = LISTEN_S) -> None:
        self._servers = servers
        self._listen_s = listen_s
        self._rang = threading.Event()
        self._lock = threading.Lock()
        #: Lanes whose bell a listener took and the claimer has not counted yet.
        self._taken: set[str] = set()
        #: Per server: set when the claimer counted its listener's bell (it may listen again).
        self._counted = {server: threading.Event() for server in servers}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the listeners (once; `stop` ends them)."""
        if self._threads:
            return
        for server, lanes in self._servers.items():
            thread = threading.Thread(
                target=self._listen, args=(server, lanes), name=f"df-rq-bell {describe(server)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for event in self._counted.values():
            event.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until a listener took a bell (True) or `timeout_s` passes (False)."""
        return self._rang.wait(timeout_s)

    def take(self, lane: str) -> int:
        """The bell a listener took for `lane` (1), now passed on to a pop of that lane, or 0."""
        with self._lock:
            if lane not in self._taken:
                return 0
            self._taken.discard(lane)
            if not self._taken:
                self._rang.clear()
        for server, lanes in self._servers.items():
            if any(candidate.name == lane for candidate in lanes):
                self._counted[server].set()
        return 1

    def _listen(self, server: Server, lanes: Sequence[Lane]) -> None:
        by_key = {lane.claims.doorbell: lane.name for lane in lanes}
        connection = lanes[0].connection
        outage = Outage(f"doorbell listener on {describe(server)}", logger)
        transient = transient_errors()
        counted = self._counted[server]
        counted.set()
        while not self._stop.is_set():
            counted.wait()  # the bell taken last has been passed on
            if self._stop.is_set():
                return
            try:
                rung = connection.blpop(list(by_key), timeout=self._listen_s)
            except transient as exc:
                self._stop.wait(outage.failed(exc))
                continue
            outage.recovered()
            if rung is None:
                continue
            counted.clear()
            with self._lock:
                self._taken.add(by_key[_text(rung[0])])
                self._rang.set()
