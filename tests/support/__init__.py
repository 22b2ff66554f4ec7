"""What the tests share, so that no test module imports another: fixtures (loaded by
tests/conftest.py; the browser's, `tests.support.browser`, by tests/browser/conftest.py), logged-in
clients, Redis servers and key clean-up, and the statement budgets the hot path is held to.

Tests reach the product through these helpers, so a module moved inside the package changes one
import here instead of many across the suite."""
