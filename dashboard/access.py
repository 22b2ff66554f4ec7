"""Who may see and steer: staff see the pages, model permissions gate each operation."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

View = Callable[..., HttpResponse]

#: The operations' model permissions (see `WorkflowRun.Meta.permissions`).
PERMISSIONS = {
    "cancel": "durable_flow.cancel_workflowrun",
    "retry": "durable_flow.retry_workflowrun",
    "signal": "durable_flow.signal_workflowrun",
    "start": "durable_flow.start_workflowrun",
}


def staff_page(view: View) -> View:
    """Anonymous users go to the login page; signed-in users who are not staff get 403."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not (request.user.is_active and request.user.is_staff):
            raise PermissionDenied("the dashboard is for staff")
        return view(request, *args, **kwargs)

    return wrapper


def require(request: HttpRequest, operation: str) -> None:
    """403 unless the user holds the operation's permission."""
    if not request.user.has_perm(PERMISSIONS[operation]):
        raise PermissionDenied(f"needs the {PERMISSIONS[operation]} permission")


def allowed(request: HttpRequest) -> dict[str, bool]:
    """Which operations the user may perform (buttons are shown disabled otherwise)."""
    return {f"can_{op}": request.user.has_perm(perm) for op, perm in PERMISSIONS.items()}
