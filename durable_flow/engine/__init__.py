"""The engine: starts runs, replays turns, admits and dispatches steps, records results.

`Engine` (in `core`) holds the parts below, built in this order, each given only what it calls
(none calls back up the list), and hands each operation other code calls to its owner:

- `dispatch`: `Dispatcher`, a step call's checkpoint and a new attempt sent out (to the
  transport, or inline to the worker thread that dispatched it; `inline_handoff`);
- `handoff`: `Grants`, room the admission backend grants dispatched from the waiters'
  checkpoints with no replay; `GrantTimer`, which grants a rate window's room when it reopens;
  the poller's safety net (re-offer, stray slots);
- `release_order`: `Releases`, a settled call's slot (or place in line) given back, after its
  run's inline turn or at that turn's first admission;
- `admit`: `Admitter`, a step call's slot, or its place in the queue's waiting line;
- `start_window`: `StartWindow`, a granted step's start counted in its rate window right
  before the call (each queue's margin: `start_margins`);
- `wake`: `Waker`, a parked run set pending with a turn queued;
- `lifecycle`: `Lifecycle`, start, child start, finish, cancel, signals;
- `calls`: `TurnCalls`, what a replaying workflow's calls (`ctx`) reach in the parts above;
- `turns`: `Turns`, a run's replay, queued or taken inline after a result;
- `results`: `Results`, a step attempt run and its result recorded exactly once; a step whose
  slot was lost sent back through admission;
- `optimistic`: `FirstTurns`, a run's first plain step run before anything is written and
  recorded with its result.

Below them: `locking` (`retry_on_conflict`, `one`, `locked_run`: the run row, then a
checkpoint), `statements` (the hottest statements, built once per process), `step_start`
(starting an attempt on a worker in one `UPDATE ... RETURNING`), `user_code` (which exceptions
are user code's failure) and `base` (status groups, the clock's type, `settle`).
"""

from durable_flow.config.settings import build_backend
from durable_flow.engine.core import Engine, get_engine, set_engine
from durable_flow.engine.locking import locked_run, one, retry_on_conflict
from durable_flow.store.queues import persist_configured_queues, write_queues

__all__ = [
    "Engine",
    "build_backend",
    "get_engine",
    "locked_run",
    "one",
    "persist_configured_queues",
    "retry_on_conflict",
    "set_engine",
    "write_queues",
]
