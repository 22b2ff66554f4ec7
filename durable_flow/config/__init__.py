"""Configuration: the one validator (`validation`), stored lengths (`limits`), backend options
(`options`), queue declarations (`queues`) and `settings.DURABLE_FLOW` parsed once (`settings`).

The lowest layer above `durable_flow.exceptions`: it imports no other part of the package."""
