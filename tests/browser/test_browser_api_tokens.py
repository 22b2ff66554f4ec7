"""An access token made in the admin, in real Chromium against a real daphne server: the page
shows it once, and a script calls the API with it (no cookie, no CSRF token)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from durable_flow.models import AccessToken
from tests.support.browser import login, shoot


def call(server: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{server}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("width", [1400, 420])
def test_a_token_made_in_the_admin_calls_the_api(browser: Any, server: str, width: int) -> None:
    page = login(browser, server, width)
    page.goto(f"{server}/admin/durable_flow/accesstoken/add/")
    page.fill("#id_name", "nightly export")
    shoot(page, "admin-token-add")
    page.click("input[name=_save]")
    page.wait_for_selector("#access-token")
    shoot(page, "admin-token-created")
    token = page.input_value("#access-token")
    assert token.startswith(AccessToken.objects.get().prefix)

    status, body = call(server, "/api/runs/", token)
    assert (status, body) == (200, {"runs": [], "next_cursor": None})
    status, body = call(server, "/api/runs/", token, {"workflow": "no.such"})
    assert status == 404 and body["error"] == "WorkflowNotFound"  # a POST with no CSRF token gets through

    page.goto(f"{server}/admin/durable_flow/accesstoken/")
    assert token not in page.content()
    shoot(page, "admin-token-list")
    page.check("input[name=_selected_action]")
    page.select_option("select[name=action]", "revoke_selected")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist")
    status, body = call(server, "/api/runs/", token)
    assert status == 401 and body["error"] == "InvalidToken"
