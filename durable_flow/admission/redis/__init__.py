"""The `redis` admission backend: one exact cap across the fleet, decided by Lua scripts
(`*.lua`, loaded by `resources.lua()`)."""
