"""Personal access tokens: created in the admin (shown once, only a digest stored), revocable,
expiring, and never more than their user: the API checks the user's permissions as for a
session, and a token request needs no CSRF token."""

from __future__ import annotations

import hashlib
import io
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from durable_flow.models import AccessToken, RunStatus, WorkflowRun
from durable_flow.operations import api
from tests.support.clients import create_user, logged_in

pytestmark = pytest.mark.inline_only("about who may call the API; the engine pair does not change it")

TOKEN = re.compile(r"dfp_[A-Za-z0-9_-]{43}")


def issue(user: Any, name: str = "script", **fields: Any) -> str:
    """A token for `user`, made the way the admin makes one; its clear value."""
    token = AccessToken(user=user, name=name, **fields)
    clear = token.set_new_token()
    token.save()
    return clear


def bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def start_body(run_id: str) -> dict[str, Any]:
    return {"data": json.dumps({"workflow": "tests.sleeper", "input": 600, "run_id": run_id})}


def database_dump() -> str:
    """Every row of every table, as `dumpdata` writes them (django_rq's models are no tables)."""
    out = io.StringIO()
    call_command("dumpdata", exclude=["django_rq"], stdout=out)
    return out.getvalue()


def test_the_admin_shows_a_new_token_once_and_stores_only_its_digest(engine: Any) -> None:
    admin = logged_in(create_user("root", superuser=True), csrf=True)
    admin.get("/admin/durable_flow/accesstoken/add/")  # sets the CSRF cookie
    csrf = admin.cookies["csrftoken"].value
    owner = create_user("ops", permissions=["start_workflowrun"])
    response = admin.post(
        "/admin/durable_flow/accesstoken/add/",
        {"user": owner.pk, "name": "export", "expires_at_0": "", "expires_at_1": "", "csrfmiddlewaretoken": csrf},
    )
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    token = TOKEN.search(response.content.decode())
    assert token is not None
    row = AccessToken.objects.get()
    assert row.user == owner and row.digest == hashlib.sha256(token[0].encode()).hexdigest()
    assert token[0].startswith(row.prefix)
    assert token[0] not in database_dump()  # not in the token's row, the admin's log, a session or a message
    assert token[0] not in admin.get(f"/admin/durable_flow/accesstoken/{row.pk}/change/").content.decode()
    assert token[0] not in admin.get("/admin/durable_flow/accesstoken/").content.decode()

    started = Client(enforce_csrf_checks=True).post(
        "/api/runs/", content_type="application/json", **start_body("by-token"), **bearer(token[0])
    )
    assert started.status_code == 201  # no cookie, no CSRF token: the bearer token is enough
    assert WorkflowRun.objects.get(pk="by-token").status == RunStatus.SUSPENDED
    assert AccessToken.objects.get().last_used_at is not None


def test_staff_make_tokens_for_themselves_only_and_see_only_theirs(engine: Any) -> None:
    alice = create_user("alice")
    alice.user_permissions.add(*Permission.objects.filter(codename__endswith="_accesstoken"))
    root = create_user("root", superuser=True)
    issue(root, name="roots-token")
    client = logged_in(alice)
    response = client.post(
        "/admin/durable_flow/accesstoken/add/",
        {"user": root.pk, "name": "mine", "expires_at_0": "", "expires_at_1": ""},
    )
    assert response.status_code == 200
    assert AccessToken.objects.get(name="mine").user == alice  # the posted user is ignored
    listing = client.get("/admin/durable_flow/accesstoken/").content.decode()
    assert "mine" in listing and "roots-token" not in listing  # root's token is not alice's to see
    roots = AccessToken.objects.get(user=root)
    assert client.get(f"/admin/durable_flow/accesstoken/{roots.pk}/change/").status_code in (302, 404)


def test_a_revoked_token_is_refused_from_then_on(engine: Any) -> None:
    admin = logged_in(create_user("root", superuser=True))
    token = issue(create_user("ops"))
    assert Client().get("/api/runs/", **bearer(token)).status_code == 200
    row = AccessToken.objects.get()
    response = admin.post(
        "/admin/durable_flow/accesstoken/",
        {"action": "revoke_selected", "_selected_action": [row.pk]},
    )
    assert response.status_code == 302
    assert AccessToken.objects.get().revoked_at is not None
    refused = Client().get("/api/runs/", **bearer(token))
    assert refused.status_code == 401 and refused.json()["error"] == "InvalidToken"
    assert refused["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "case",
    ["expired", "unknown", "revoked", "inactive user", "empty", "not ascii", "too long"],
)
def test_a_token_that_is_not_valid_is_a_json_401(engine: Any, case: str) -> None:
    user = create_user("ops", permissions=["start_workflowrun"])
    now = timezone.now()
    if case == "expired":
        token = issue(user, expires_at=now - timedelta(seconds=1))
    elif case == "revoked":
        token = issue(user, revoked_at=now)
    elif case == "inactive user":
        token = issue(user)
        user.is_active = False
        user.save()
    else:
        issue(user)
        token = {"unknown": "dfp_" + "x" * 43, "empty": "", "not ascii": "dfp_é", "too long": "dfp_" + "x" * 300}[case]
    response = Client().post("/api/runs/", content_type="application/json", **start_body("no"), **bearer(token))
    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"] == "InvalidToken"
    assert not WorkflowRun.objects.exists()


def test_a_token_not_yet_expired_works(engine: Any) -> None:
    token = issue(create_user("ops"), expires_at=timezone.now() + timedelta(hours=1))
    assert Client().get("/api/runs/", **bearer(token)).status_code == 200


def test_a_token_has_its_users_permissions_no_more(engine: Any) -> None:
    user = create_user("viewer", permissions=["start_workflowrun"])
    token = issue(user)
    client = Client(enforce_csrf_checks=True)
    assert client.post("/api/runs/", content_type="application/json", **start_body("r1"), **bearer(token)).status_code
    refused = client.post("/api/runs/r1/cancel/", **bearer(token))
    assert refused.status_code == 403 and refused.json()["error"] == "PermissionDenied"
    assert "cancel_workflowrun" in refused.json()["message"]
    assert WorkflowRun.objects.get(pk="r1").status == RunStatus.SUSPENDED
    # Given the permission, the same token may cancel: it checks the user's permissions now.
    user.user_permissions.add(Permission.objects.get(codename="cancel_workflowrun"))
    cancelled = client.post("/api/runs/r1/cancel/", **bearer(token))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == RunStatus.CANCELLED


def test_a_token_of_a_user_who_is_not_staff_is_refused(engine: Any) -> None:
    token = issue(create_user("plain", staff=False, permissions=["start_workflowrun"]))
    response = Client().post("/api/runs/", content_type="application/json", **start_body("no"), **bearer(token))
    assert response.status_code == 403 and response.json()["error"] == "PermissionDenied"
    assert not WorkflowRun.objects.exists()


def test_a_session_post_still_needs_its_csrf_token(engine: Any) -> None:
    user = create_user("ops", permissions=["start_workflowrun"])
    client = logged_in(user, csrf=True)
    refused = client.post("/api/runs/", content_type="application/json", **start_body("no"))
    assert refused.status_code == 403
    assert refused["Content-Type"] == "application/json" and refused.json()["error"] == "CsrfFailed"
    assert not WorkflowRun.objects.exists()
    assert client.get("/api/runs/").status_code == 200  # a GET needs none
    client.get("/admin/")  # the admin sets the CSRF cookie
    csrf = client.cookies["csrftoken"].value
    started = client.post("/api/runs/", content_type="application/json", HTTP_X_CSRFTOKEN=csrf, **start_body("yes"))
    assert started.status_code == 201


def test_another_authorization_scheme_is_left_to_the_session(engine: Any) -> None:
    """A proxy's Basic authentication in front of the site does not lock session callers out."""
    client = logged_in(create_user("ops"))
    assert client.get("/api/runs/", HTTP_AUTHORIZATION="Basic b3BzOnB3").status_code == 200
    assert Client().get("/api/runs/", HTTP_AUTHORIZATION="Basic b3BzOnB3").status_code == 401


def test_last_used_is_written_at_most_once_a_minute(engine: Any) -> None:
    token = issue(create_user("ops"))
    Client().get("/api/runs/", **bearer(token))
    first = AccessToken.objects.get().last_used_at
    assert first is not None
    Client().get("/api/runs/", **bearer(token))
    assert AccessToken.objects.get().last_used_at == first
    AccessToken.objects.update(last_used_at=first - timedelta(minutes=2))
    Client().get("/api/runs/", **bearer(token))
    assert AccessToken.objects.get().last_used_at > first


def test_a_run_started_by_token_is_audited_under_its_user(engine: Any) -> None:
    user = create_user("ops", permissions=["start_workflowrun"])
    token = issue(user)
    Client().post("/api/runs/", content_type="application/json", **start_body("audited"), **bearer(token))
    assert api.get_run("audited").status == RunStatus.SUSPENDED
    assert LogEntry.objects.get(object_id="audited").user == user
