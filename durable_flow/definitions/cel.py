"""CEL (via `cel-python`) for the expressions users write in settings and decorators: quota keys
and step-concurrency keys. Compiled once, at registration; evaluated over JSON variables."""

from __future__ import annotations

from typing import Any


def compile_cel(expression: str) -> Any:
    """The compiled program of `expression`; `ValueError` naming it if it does not compile."""
    import celpy

    env = celpy.Environment()
    try:
        return env.program(env.compile(expression))
    except Exception as exc:  # noqa: BLE001 - celpy's parse errors share no public base class
        raise ValueError(f"{expression!r} is not a valid CEL expression: {exc}") from None


def evaluate_cel(program: Any, **variables: Any) -> Any:
    """Run a compiled program over JSON `variables`; `LookupError` with CEL's message if it fails
    on them (a missing field, a type mismatch)."""
    from celpy import CELEvalError, json_to_cel

    try:
        return program.evaluate({name: json_to_cel(value) for name, value in variables.items()})
    except CELEvalError as exc:
        raise LookupError(exc.args[0]) from None
