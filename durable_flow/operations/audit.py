"""The audit trail: every operation a person performs through the admin or the JSON API is an
admin `LogEntry` (who, when, what), so it shows in the object's History page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import Model


def record_operation(user: Any, obj: Model, message: str) -> None:
    """Log `message` (e.g. "Cancelled", "Sent signal 'approve'") against `obj` for `user`."""
    if user is None or not getattr(user, "is_authenticated", False):
        return
    LogEntry.objects.log_actions(
        user_id=user.pk, queryset=[obj], action_flag=CHANGE, change_message=message, single_object=True
    )


def record_operations(user: Any, objs: Sequence[Model], message: str) -> None:
    """Log `message` against each of `objs` (one entry each, so each object's History shows
    it), in one bulk INSERT."""
    if not objs or user is None or not getattr(user, "is_authenticated", False):
        return
    LogEntry.objects.log_actions(user_id=user.pk, queryset=objs, action_flag=CHANGE, change_message=message)
