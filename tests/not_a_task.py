"""A module no task run may import: a run's input names `tests.not_a_task.touch` in
tests/processes/test_task_declarations.py. Importing it, or calling `touch`, leaves a marker file, so a
worker process that did either is seen from the test."""

from __future__ import annotations

import os
from pathlib import Path

_IMPORT_MARKER = os.environ.get("DURABLE_FLOW_TEST_IMPORT_MARKER")
if _IMPORT_MARKER:
    Path(_IMPORT_MARKER).write_text("imported")


def touch(path: str) -> None:
    Path(path).write_text("called")
