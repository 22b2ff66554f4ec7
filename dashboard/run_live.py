"""The run page's live topic, `run:<id>`: its badge, facts, waits and timeline re-rendered every
tick (`run_views.run_fragments`), so a signal that completes the run shows without a reload."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .live import register_topic
from .run_views import run_fragments


def _run(_: Mapping[str, Any], run_id: str) -> dict[str, str] | None:
    return run_fragments(run_id)


register_topic("run", _run, uses_snapshot=False)  # reads only its run
