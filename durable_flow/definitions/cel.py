"""CEL for the expressions users write in settings and decorators: quota keys, step-concurrency
keys, debounce and singleton keys. Compiled once, at registration; evaluated over JSON variables.

The engine is `common-expression-language` (Python bindings of the Rust `cel` crate): a key is
evaluated on every start that declares one, and the Rust evaluator is far cheaper than a pure
Python one (see `bench/cel_keys.py`). This module is the only place that imports it, so the rest
of the project sees two functions and two exception types: `ValueError` for an expression that
does not compile, `LookupError` for one that fails on the variables it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cel import Program

#: What `Program.execute` raises when an expression fails on its variables: `KeyError` for a
#: missing map key, `IndexError` for a list index out of range, `TypeError` for operands with no
#: overload, `RuntimeError` for an undeclared variable or function, `ArithmeticError` for a
#: division by zero or an overflow, `ValueError` for anything else the bindings do not map.
EVALUATION_ERRORS = (LookupError, TypeError, RuntimeError, ArithmeticError, ValueError)

_PARSE_PREFIX = "Failed to parse expression "


def compile_cel(expression: str) -> Program:
    """The compiled program of `expression`; `ValueError` naming it if it does not compile."""
    # Imported here: a process whose workflows declare no CEL key never loads the bindings.
    import cel

    try:
        return cel.compile(expression)
    except ValueError as exc:
        reason = str(exc)
        # The bindings repeat the expression ("Failed to parse expression '<it>': ..."); it is
        # named once, first, here.
        prefix = f"{_PARSE_PREFIX}'{expression}': "
        if reason.startswith(prefix):
            reason = reason[len(prefix) :]
        raise ValueError(f"{expression!r} is not a valid CEL expression: {reason}") from None


def evaluate_cel(program: Program, **variables: Any) -> Any:
    """Run a compiled program over JSON `variables` (plain Python values back: str, int, float,
    bool, None, list, dict); `LookupError` with CEL's message if it fails on them (a missing
    field, a type mismatch, a division by zero)."""
    try:
        return program.execute(variables)
    except KeyError as exc:
        # The bindings' KeyError carries the bare key; say what it is.
        raise LookupError(f"no such key: {exc.args[0]!r}" if exc.args else "no such key") from None
    except EVALUATION_ERRORS as exc:
        raise LookupError(str(exc)) from None
