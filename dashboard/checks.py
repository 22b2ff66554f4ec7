"""System checks of the dashboard's own settings: a bad value shows in `manage.py check` with an
id and a hint, rather than as a 500 from the page that reads it.

- `dashboard.E001`: `DASHBOARD_BURST` is malformed (not a dict, an unknown key, a name the
  database cannot store, a `SIZE` that is no whole number from 1 to `MAX_BURST`, an `INPUT`
  that is no dict).
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from dashboard.flow import MAX_BURST, burst_problem

HINT = (
    f'DASHBOARD_BURST is {{"WORKFLOW": <workflow name>, "QUEUE": <queue name>, "SIZE": 1 to {MAX_BURST}, '
    '"INPUT": {...}}, each key optional (see README.md, the flow view); NaN, infinities and True/False are refused.'
)


@checks.register("dashboard")
def check_burst(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check `DASHBOARD_BURST`, which the flow view's burst button reads."""
    from django.conf import settings

    problem = burst_problem(getattr(settings, "DASHBOARD_BURST", {}))
    return [checks.Error(problem, hint=HINT, id="dashboard.E001")] if problem else []
