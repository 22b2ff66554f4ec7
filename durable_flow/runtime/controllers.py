"""The CONCURRENCY setting parsed into a worker's controller, fixed or adaptive.

`TRANSPORT["CONCURRENCY"]` is a number, `"adaptive"`, or a dict
`{"mode": "adaptive", "min": 1, "max": 32, "start": 1, "tick_ms": 2000,
"ram_ceiling_pct": 85, "cpu_ceiling_pct": None}`. This module sits above both controllers so
that `concurrency` and `adaptive` never import each other both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.validation import number_problem
from durable_flow.runtime.adaptive import AdaptiveConcurrency
from durable_flow.runtime.concurrency import MAX_CONCURRENCY, ConcurrencyController, FixedConcurrency


def build_controller(spec: object, setting: str = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]') -> ConcurrencyController:
    """Parse a CONCURRENCY setting into its controller; `ImproperlyConfigured` names the setting."""
    if spec == "adaptive" or (isinstance(spec, Mapping) and spec.get("mode") == "adaptive"):
        options: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {}
        return AdaptiveConcurrency.from_spec(options, setting=setting)
    problem = number_problem(spec, minimum=1, maximum=MAX_CONCURRENCY, integer=True)
    if problem:
        raise ImproperlyConfigured(f"{setting}: {problem} (or 'adaptive', or an adaptive spec dict)")
    return FixedConcurrency(spec)  # type: ignore[arg-type]  # an int, checked above
