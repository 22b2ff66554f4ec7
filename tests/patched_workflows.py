"""A workflow whose code changes between "deploys": `DURABLE_FLOW_TEST_PATCH` picks the code a
process runs (read at each turn, so a test can also switch it in-process).

- `old`: the second step is `add_one`.
- `patched`: `ctx.patched("double-second")` picks `double` for runs that had not recorded the
  second step, `add_one` for those that had.
- `removed`: the old branch and the `patched` call are gone: always `double`.

Each run waits for the signal `go` before the changed call and for `finish` after it, so a test
holds runs on either side of the change while it deploys.
"""

from __future__ import annotations

import os
from typing import Any

from durable_flow import workflow
from tests.workflows import add_one, double

PATCH_ID = "double-second"
CODES = ("old", "patched", "removed")


def _code() -> str:
    code = os.environ.get("DURABLE_FLOW_TEST_PATCH", "old")
    if code not in CODES:
        raise ValueError(f"DURABLE_FLOW_TEST_PATCH must be one of {CODES}, got {code!r}")
    return code


@workflow("tests.patched_flow")
def patched_flow(ctx: Any, n: int) -> dict[str, Any]:
    first = ctx.step(add_one, n)
    ctx.wait_for_signal("go")
    code = _code()
    if code == "removed" or (code == "patched" and ctx.patched(PATCH_ID)):
        second, path = ctx.step(double, first), "new"
    else:
        second, path = ctx.step(add_one, first), "old"
    ctx.wait_for_signal("finish")
    return {"path": path, "second": second}


@workflow("tests.patched_first")
def patched_first(ctx: Any, n: int) -> int:
    """`ctx.patched` before any call: a new run's first turn records the marker, then the step."""
    return ctx.step(double, n) if ctx.patched("first-call") else ctx.step(add_one, n)
