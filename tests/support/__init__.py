"""What the tests share: fixtures (`tests.support.fixtures`, loaded by tests/conftest.py), logged-in
clients, Redis servers and key clean-up, and the statement budgets the hot path is held to.

Tests reach the product through these helpers, so a module moved inside the package changes one
import here instead of many across the suite."""
