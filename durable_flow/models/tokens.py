"""Personal access tokens for the JSON API: a script sends `Authorization: Bearer <token>` and
acts as the token's user, with that user's permissions.

Only a SHA-256 digest of a token is stored. A token is 32 random bytes (`secrets.token_urlsafe`)
behind a visible `dfp_` marker, so a digest without a salt is enough: nothing short of the token
itself finds it, and a leaked table gives no token back. Its first characters (`prefix`) are kept
in clear so a person can tell their tokens apart and find a leaked one; the clear token is shown
once, when it is created.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.conf import settings
from django.db import models

#: What every token starts with: it tells a secret scanner and a reader what the string is.
TOKEN_MARKER = "dfp_"
#: The characters of a token kept in clear (the marker and 8 random characters).
PREFIX_LENGTH = len(TOKEN_MARKER) + 8
#: The longest header value taken for a token: longer is not one of ours, and is not hashed.
MAX_TOKEN_LENGTH = 200


def token_digest(token: str) -> str:
    """The stored form of a token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


class AccessToken(models.Model):
    """A personal access token: owned by a user, revocable, optionally expiring."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="durable_flow_tokens",
        help_text="The token acts as this user, with this user's permissions.",
    )
    name = models.CharField(max_length=100, help_text="What the token is for, e.g. the script or job using it.")
    prefix = models.CharField(
        max_length=PREFIX_LENGTH, editable=False, help_text="The token's first characters, to recognise it."
    )
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="After this the token is refused; empty: it never expires."
    )
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False, help_text="To the minute.")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "access token"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def set_new_token(self) -> str:
        """Give this token a new secret (stored as its digest) and return it in clear, the only
        time it is seen."""
        token = TOKEN_MARKER + secrets.token_urlsafe(32)
        self.prefix = token[:PREFIX_LENGTH]
        self.digest = token_digest(token)
        return token

    def is_usable(self, now: datetime) -> bool:
        """Not revoked, not expired, and its user may still log in."""
        if self.revoked_at is not None or (self.expires_at is not None and self.expires_at <= now):
            return False
        return bool(getattr(self.user, "is_active", True))
