"""The CONCURRENCY setting parsed into a worker's controller, fixed or adaptive.

`TRANSPORT["CONCURRENCY"]` is a number, `"adaptive"`, or a dict
`{"mode": "adaptive", "min": 1, "max": 32, "start": 1, "tick_ms": 2000,
"ram_ceiling_pct": 85, "cpu_ceiling_pct": None}`. The value is parsed and checked by
`durable_flow.config.concurrency` (the transports check it there too); this module sits above
both controllers so that `concurrency` and `adaptive` never import each other both ways.
"""

from __future__ import annotations

from durable_flow.config.concurrency import DEFAULT_SETTING, parse_worker_concurrency
from durable_flow.runtime.adaptive import AdaptiveConcurrency
from durable_flow.runtime.concurrency import ConcurrencyController, FixedConcurrency


def build_controller(spec: object, setting: str = DEFAULT_SETTING) -> ConcurrencyController:
    """Parse a CONCURRENCY setting into its controller; `ImproperlyConfigured` names the setting."""
    parsed = parse_worker_concurrency(spec, setting)
    if isinstance(parsed, int):
        return FixedConcurrency(parsed)
    return AdaptiveConcurrency.from_parsed(parsed)
