"""The engine: starts runs, replays turns, admits and dispatches steps, records results.

`Engine` (in `core`) is the facade; its parts are one module per responsibility:

- `locking`: `retry_on_conflict`, `one`, `locked_run` (lock the run row, then a checkpoint),
  `locked_run_for_result` (the run row, then a result's checkpoint, or all of a lone call's);
- `lifecycle`: start, child start, finish, cancel, signals;
- `turns`: replay, the inline continuation, wake;
- `dispatch`: step checkpoint creation, admission (or parking in the line), dispatch, re-admission;
- `handoff`: slots granted to parked waiters, dispatched from their checkpoints with no replay;
  the grant timer for reopening rate windows; the start window; the poller's safety net;
- `results`: executing a step attempt and recording its result exactly once;
- `step_start`: starting a step attempt on a worker in one `UPDATE ... RETURNING`.
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
