"""Removing the keys a test left in Redis: only those matching its patterns, never a whole database."""

from __future__ import annotations

from redis import Redis


def delete_keys(client: Redis, *patterns: str) -> None:
    """Delete every key matching one of `patterns` (SCAN, so a large keyspace is never blocked)."""
    for pattern in patterns:
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
