"""The worker runtime shared by every transport: a thread pool whose live limit a
concurrency controller (fixed or adaptive) sets, and a heartbeat that reports it."""
