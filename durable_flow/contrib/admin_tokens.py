"""Personal access tokens in the Django admin: create one (shown in clear once, on the page the
save answers with, never stored or sent again), see when each was last used, revoke.

A staff user makes tokens for themselves only and sees only their own; a superuser may make one
for any user and sees them all. A token never carries more than its user: the API checks the
user's permissions on every request, so taking a permission away takes it from their tokens too.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from durable_flow.models import AccessToken

#: Where `save_model` leaves the clear token for `response_add`, on the request (never on the
#: shared admin instance, never in the session).
NEW_TOKEN_ATTRIBUTE = "durable_flow_new_token"


class AccessTokenAdminMixin:
    """The `ModelAdmin` of `AccessToken` (mixed into the app's URL-safe admin)."""

    list_display = ["name", "user", "prefix", "state", "created_at", "expires_at", "last_used_at"]
    list_filter = ["created_at"]
    search_fields = ["^prefix", "name", "user__username"]
    ordering = ["-created_at"]
    actions = ["revoke_selected"]
    raw_id_fields = ["user"]  # a superuser picks any user: no select of every user on the page

    def get_queryset(self, request: HttpRequest) -> QuerySet[AccessToken]:
        tokens = super().get_queryset(request).select_related("user")  # type: ignore[misc]
        return tokens if request.user.is_superuser else tokens.filter(user=request.user)

    def get_fields(self, request: HttpRequest, obj: AccessToken | None = None) -> list[str]:
        if obj is None:
            return ["user", "name", "expires_at"] if request.user.is_superuser else ["name", "expires_at"]
        return ["user", "name", "prefix", "expires_at", "created_at", "last_used_at", "revoked_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: AccessToken | None = None) -> list[str]:
        return [] if obj is None else ["user", "prefix", "created_at", "last_used_at", "revoked_at"]

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        return {"user": request.user.pk}

    def save_model(self, request: HttpRequest, obj: AccessToken, form: ModelForm, change: bool) -> None:
        if not change:
            if not request.user.is_superuser:
                obj.user = request.user  # type: ignore[assignment]  # a staff user's own token only
            setattr(request, NEW_TOKEN_ATTRIBUTE, obj.set_new_token())
        super().save_model(request, obj, form, change)  # type: ignore[misc]

    def response_add(
        self, request: HttpRequest, obj: AccessToken, post_url_continue: str | None = None
    ) -> HttpResponse:
        """The clear token, once, on a page no cache keeps (not a message: those are stored)."""
        response = TemplateResponse(
            request,
            "admin/durable_flow/accesstoken/created.html",
            {
                **self.admin_site.each_context(request),  # type: ignore[attr-defined]
                "opts": AccessToken._meta,
                "title": "Access token created",
                "token": obj,
                "clear_token": getattr(request, NEW_TOKEN_ATTRIBUTE),
            },
        )
        add_never_cache_headers(response)
        return response

    @admin.display(description="State")
    def state(self, obj: AccessToken) -> str:
        if obj.revoked_at is not None:
            return "revoked"
        if obj.expires_at is not None and obj.expires_at <= timezone.now():
            return "expired"
        return "active"

    @admin.action(description="Revoke selected access tokens", permissions=["change"])
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[AccessToken]) -> None:
        revoked = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {revoked} access token(s).", messages.SUCCESS)  # type: ignore[attr-defined]
