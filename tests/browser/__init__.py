"""The dashboard and the admin in a real headless Chromium (Playwright) against a real daphne server."""
