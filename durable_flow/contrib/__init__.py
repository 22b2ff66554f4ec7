"""Integrations over the public API: the admin's helpers, the JSON API and its error mapping,
the Django tasks backend, the Prometheus metrics view and the health middleware."""
