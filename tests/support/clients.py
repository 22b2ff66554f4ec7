"""Logged-in Django test clients: the dashboard's staff and the JSON API's callers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client


@dataclass(frozen=True)
class StaffLogin:
    """Who the shared `staff` user is; a module overrides the `staff_login` fixture to change it."""

    username: str = "staff"
    superuser: bool = True
    #: Enforce CSRF checks, as a browser posting the dashboard's forms meets them.
    csrf: bool = True


def create_user(username: str, *, staff: bool = True, superuser: bool = False, permissions: Sequence[str] = ()) -> Any:
    """A user with password "pw" and the given `durable_flow` permission codenames."""
    user = get_user_model().objects.create_user(username, password="pw", is_staff=staff, is_superuser=superuser)
    if permissions:
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="durable_flow", codename__in=list(permissions))
        )
    return user


def logged_in(user: Any, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def logged_in_client(
    username: str,
    *,
    staff: bool = True,
    superuser: bool = False,
    permissions: Sequence[str] = (),
    csrf: bool = False,
) -> Client:
    """A client logged in as a new user: the JSON API's and the admin's caller in tests."""
    return logged_in(create_user(username, staff=staff, superuser=superuser, permissions=permissions), csrf=csrf)
