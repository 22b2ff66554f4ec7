"""CEL for the expressions users write in settings and decorators: quota keys, step-concurrency
keys, debounce and singleton keys. Compiled once, at registration; evaluated over JSON variables.

The engine is `common-expression-language` (Python bindings of the Rust `cel` crate): a key is
evaluated on every start that declares one, and the Rust evaluator is far cheaper than a pure
Python one (see `bench/cel_keys.py`). This module is the only place that imports it: the rest of
the project sees `compile_cel`, which gives a `CelProgram` or raises `ValueError`, and
`evaluate_cel`, which gives plain Python values or raises `LookupError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from durable_flow.config.validation import bounded_depth
from durable_flow.exceptions import InvalidInput

if TYPE_CHECKING:
    from cel import Program

#: What `Program.execute` raises when an expression fails on its variables: `KeyError` for a
#: missing map key, `IndexError` for a list index out of range, `TypeError` for operands with no
#: overload, `RuntimeError` for an undeclared variable or function, `ArithmeticError` for a
#: division by zero or an overflow, `ValueError` for anything else the bindings do not map.
EVALUATION_ERRORS = (LookupError, TypeError, RuntimeError, ArithmeticError, ValueError)

_PARSE_PREFIX = "Failed to parse expression "


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
#: A field read: `<variable>.<field>`, not a method call (`input.exists(k, ...)` reads them all).
_FIELD_READ = r"\s*\.\s*(" + _IDENTIFIER + r")\b(?!\s*\()"


@dataclass(frozen=True, slots=True, eq=False)
class CelProgram:
    """A compiled expression, the variables it names and, for those it reads only by field, the
    fields it reads (both found once, at compile time).

    The evaluator converts every value it is handed into CEL, whatever the expression reads, and
    that conversion is most of an evaluation's cost, growing with the input. So only the named
    variables are handed over, and a map variable read only as `input.<field>` is cut to those
    fields: `"tenant:" + input.tenant_id` converts one string, not the whole input.
    """

    program: Program
    variables: frozenset[str]
    fields: dict[str, frozenset[str]]

    def bindings(self, variables: dict[str, Any]) -> dict[str, Any]:
        """The values `execute` needs, out of the `variables` a caller offers."""
        named = {}
        for name, value in variables.items():
            if name not in self.variables:
                continue
            fields = self.fields.get(name)
            if fields is not None and type(value) is dict:
                value = {field: value[field] for field in fields if field in value}
            named[name] = value
        return named


def fields_read(expression: str, variable: str) -> frozenset[str] | None:
    """The fields of `variable` that `expression` reads, if every mention of the name is a field
    read (`input.tenant_id`, `input . user`); None if any is not (`input["id"]`, `size(input)`,
    `"a" in input`, `input.exists(k, ...)`, a macro's variable of that name), so the whole value
    is needed. A mention inside a string literal counts too: it can only widen what is kept."""
    mentions = list(re.finditer(rf"\b{re.escape(variable)}\b", expression))
    fields = set()
    for mention in mentions:
        read = re.match(_FIELD_READ, expression[mention.end() :])
        if read is None:
            return None
        fields.add(read.group(1))
    return frozenset(fields)


def compile_cel(expression: str) -> CelProgram:
    """The compiled program of `expression`; `ValueError` naming it if it does not compile."""
    # Imported here: a process whose workflows declare no CEL key never loads the bindings.
    import cel

    try:
        program = cel.compile(expression)
    except ValueError as exc:
        reason = str(exc)
        # The bindings repeat the expression ("Failed to parse expression '<it>': ..."); it is
        # named once, first, here.
        prefix = f"{_PARSE_PREFIX}'{expression}': "
        if reason.startswith(prefix):
            reason = reason[len(prefix) :]
        raise ValueError(f"{expression!r} is not a valid CEL expression: {reason}") from None
    variables = frozenset(program.variables())
    fields = {name: read for name in variables if (read := fields_read(expression, name)) is not None}
    return CelProgram(program=program, variables=variables, fields=fields)


def evaluate_cel(compiled: CelProgram, **variables: Any) -> Any:
    """Run a compiled program over JSON `variables` (plain Python values back: str, int, float,
    bool, None, list, dict); `LookupError` with CEL's message if it fails on them (a missing
    field, a type mismatch, a division by zero)."""
    bindings = compiled.bindings(variables)
    try:
        # The bindings convert a value recursively, in native code: a value nested deeper than
        # the stack holds would end the process, not raise. Inputs are bounded before they get
        # here (`ensure_json`); this keeps it so for any caller.
        for name, value in bindings.items():
            bounded_depth(value, name)
    except InvalidInput as exc:
        raise LookupError(str(exc)) from None
    try:
        return compiled.program.execute(bindings)
    except KeyError as exc:
        # The bindings' KeyError carries the bare key; say what it is.
        raise LookupError(f"no such key: {exc.args[0]!r}" if exc.args else "no such key") from None
    except EVALUATION_ERRORS as exc:
        raise LookupError(str(exc)) from None
