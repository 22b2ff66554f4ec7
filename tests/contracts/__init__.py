"""The contract kits (`durable_flow.testing`, Django's tasks framework's) run against every backend we ship."""
