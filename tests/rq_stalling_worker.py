"""A real `durable_worker` on the `rq` transport whose first claim stalls between the pop and
the registration in RQ's started registry, for a test to SIGKILL it right there::

    python -m tests.rq_stalling_worker <durable_worker options>

It writes the stalled job's id to the file named by `DURABLE_FLOW_TEST_STALLED`, then sleeps.
The stall is at `Execution.create`, which the registration calls first, so a pop done any way
(a booked script, or a plain `LMPOP`) is caught at the same point.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import django


def stall(cls: Any, job: Any, ttl: int, pipeline: Any, worker_name: str = "") -> Any:
    Path(os.environ["DURABLE_FLOW_TEST_STALLED"]).write_text(job.id)
    time.sleep(3600)  # the test kills this process here


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.test")
    django.setup()
    from django.core.management import execute_from_command_line
    from rq.executions import Execution

    Execution.create = classmethod(stall)  # type: ignore[method-assign, assignment]
    execute_from_command_line(["manage.py", "durable_worker", *sys.argv[1:]])


if __name__ == "__main__":
    main()
