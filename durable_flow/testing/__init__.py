"""Test helpers shipped with durable_flow, for the project and for authors of backends."""
