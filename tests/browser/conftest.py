"""The browser tests' fixtures (`tests.support.browser`): loaded here rather than by tests/conftest.py,
so only these tests need Playwright and run with `DJANGO_ALLOW_ASYNC_UNSAFE`."""

from tests.support.browser import browser, db_workers, engine_db, server  # noqa: F401
