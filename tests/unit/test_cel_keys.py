"""CEL keys, as a table: every key example of the reference documents and the project's own keys
give the same string; values keep their JSON types; a failing expression is a typed error with
CEL's reason; a value becomes a key only if it is a non-empty string (a quota key may be null).

The `cel_spec` tests are where `cel-python` (the evaluator before) departed from the CEL
specification and the Rust `cel` crate follows it; `test_cel_crate_rows` is where the crate
departs from it (docs/cel-keys.md lists both)."""

from __future__ import annotations

from typing import Any

import pytest

from durable_flow.config.validation import MAX_JSON_DEPTH
from durable_flow.definitions.cel import compile_cel, evaluate_cel, fields_read
from durable_flow.definitions.keys import evaluate_key, parse_key
from durable_flow.definitions.quotas import CelKey
from durable_flow.exceptions import InvalidInput, InvalidQuota, RegistrationError

DATA = {
    "customer_id": "c-7",
    "customerId": "c-7",
    "accountId": "acct-1",
    "user_id": "u1",
    "import_id": "i9",
    "userId": "u1",
    "importId": "i9",
    "tenant_id": "t1",
    "user": "ann",
    "n": 5,
    "big": 2**63 - 1,
    "f": 1.5,
    "whole": 2.0,
    "flag": True,
    "off": False,
    "none": None,
    "tags": ["a", "b"],
    "nested": {"k": "v", "deep": {"x": 1}},
    "uni": "héllo✓",
    "dash-key": "d",
    "args": ["first", 2],
    "kwargs": {"tenant": "t"},
}


def run(expression: str, **variables: Any) -> Any:
    return evaluate_cel(compile_cel(expression), **variables)


# -- the reference documents' examples ----------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("event.data.customer_id", "c-7"),
        ("event.data.customerId", "c-7"),
        ("event.data.accountId", "acct-1"),
        ('event.data.user_id + "-" + event.data.import_id', "u1-i9"),
        ('event.data.userId + "-" + event.data.importId', "u1-i9"),
        ('"global-quoted-key"', "global-quoted-key"),
        ('"external-api"', "external-api"),
        ('"openai"', "openai"),
    ],
)
def test_the_reference_key_examples_give_their_strings(expression: str, expected: str) -> None:
    assert run(expression, event={"data": DATA}) == expected


# -- the project's own keys, over `input`, `run_id` and `workflow` ------------------------------
PROJECT_KEYS = [
    ("input.customer_id", "c-7"),
    ('input.userId + "-" + input.importId', "u1-i9"),
    ('"user:" + input.user', "user:ann"),
    ('"tenant:" + input.tenant_id', "tenant:t1"),
    ('has(input.tenant_id) ? "tenant:" + input.tenant_id : null', "tenant:t1"),
    ('has(input.missing) ? "tenant:" + input.missing : null', None),
    ('input.user + "-" + workflow', "ann-wf"),
    ("run_id", "r-1"),
    ("input.args[0]", "first"),
    ("input.kwargs.tenant", "t"),
    ('input["dash-key"]', "d"),
    ("input.nested.deep.x", 1),
    ('"k:" + string(input.n)', "k:5"),
    ('"k:" + string(input.f)', "k:1.5"),
    ("input.uni", "héllo✓"),
    ('input.flag ? "on" : "off"', "on"),
    ('input.n > 3 ? "big" : "small"', "big"),
    ('input.user.startsWith("a")', True),
    ('input.user.matches("^a.n$")', True),
    ('"a" in input.tags', True),
    ('"k" in input.nested', True),
    ('input.tags.exists(t, t == "b")', True),
    ('input.tags.map(t, t + "!")', ["a!", "b!"]),
    ("size(input.tags)", 2),
    ("size(input.nested)", 2),
    ("size(input.user)", 3),
    ("has(input.none)", True),
    ("input.n == 4 && input.missing == 1", False),  # short-circuits past the error
    ("input.missing == 1 || input.n == 5", True),
    ('input.user < "bob"', True),
    ("input.none == null", True),
    ("input.n / 2", 2),
    ("int(input.f)", 1),
    ('int("12")', 12),
    ("double(input.n)", 5.0),
    ("string(3u)", "3"),
    ("uint(input.n)", 5),
    ("type(input.n) == int", True),
]


@pytest.mark.parametrize(("expression", "expected"), PROJECT_KEYS)
def test_the_projects_keys_and_operators(expression: str, expected: Any) -> None:
    assert run(expression, input=DATA, run_id="r-1", workflow="wf") == expected


@pytest.mark.parametrize(
    ("value", "cel_type"),
    [("s", "string"), (5, "int"), (1.5, "double"), (True, "bool"), (None, "null_type")],
)
def test_json_values_keep_their_cel_type_and_come_back_as_plain_python(value: Any, cel_type: str) -> None:
    assert run(f"type(input.v) == {cel_type}", input={"v": value}) is True
    result = run("input.v", input={"v": value})
    assert (type(result), result) == (type(value), value)


def test_an_integer_past_int64_arrives_as_a_uint_then_as_a_double() -> None:
    assert run("type(input.v) == uint", input={"v": 2**63}) is True
    assert run("type(input.v) == double", input={"v": 2**70}) is True


def test_lists_and_maps_come_back_as_lists_and_dicts() -> None:
    assert run("input.nested", input=DATA) == {"k": "v", "deep": {"x": 1}}
    assert run("input.args", input=DATA) == ["first", 2]
    assert run("input", input=None) is None


# -- where the evaluator before departed from the CEL specification -----------------------------
@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("input.n == 5.0", True),  # CEL spec: numbers compare across int and double
        ("input.whole == 2", True),
        ("input.n < 5.5", True),
        ("input.flag == 1", False),  # CEL spec: a bool is not the int 1
        ("null == 0", False),
        ('"k:" + string(input.whole)', "k:2"),  # CEL spec: a whole double prints without ".0"
    ],
)
def test_cel_spec_rows(expression: str, expected: Any) -> None:
    assert run(expression, input=DATA) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "has(input.missing.x)",  # CEL spec: has() of a field of a missing field is an error
        "1 + 2u",  # CEL spec: no arithmetic across int and uint
        "string(input.none)",  # CEL spec: string() has no null overload
    ],
)
def test_cel_spec_error_rows(expression: str) -> None:
    with pytest.raises(LookupError):
        run(expression, input=DATA)


def test_cel_crate_rows() -> None:
    """Where the `cel` crate departs from the CEL specification: `size` of a string counts
    UTF-8 bytes, not code points, and `string()` has no bool overload."""
    assert run("size(input.uni)", input=DATA) == len(DATA["uni"].encode())
    with pytest.raises(LookupError, match="string"):
        run('"k:" + string(input.flag)', input=DATA)


# -- failures: typed, with CEL's reason ---------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "variables", "reason"),
    [
        ("input.missing", {"input": DATA}, "no such key: 'missing'"),
        ("input.nested.missing", {"input": DATA}, "no such key: 'missing'"),
        ('input["x"]', {"input": {}}, "no such key: 'x'"),
        ("input.tags[5]", {"input": DATA}, "index out of bounds"),
        ("input.a", {"input": None}, "No such overload"),
        ("input.a", {"input": "text"}, "No such overload"),
        ("input.none.a", {"input": DATA}, "No such overload"),
        ("undefined_var", {"input": DATA}, "Undefined variable or function: 'undefined_var'"),
        ("input.user + input.n", {"input": DATA}, "string \\+ int"),
        ("input.n + 1.0", {"input": DATA}, "No such overload"),
        ("input.n / 0", {"input": DATA}, "division by zero"),
        ("input.big + 1", {"input": DATA}, "overflow"),
        ('int("x")', {}, "invalid digit"),
        ("uint(-1)", {}, "overflow"),
    ],
)
def test_an_expression_that_fails_on_its_variables_is_a_lookup_error_with_cels_reason(
    expression: str, variables: dict[str, Any], reason: str
) -> None:
    with pytest.raises(LookupError, match=reason):
        run(expression, **variables)


@pytest.mark.parametrize("expression", ["size(input)", "size(input.v)"])
def test_a_value_nested_deeper_than_the_json_limit_is_a_lookup_error_not_a_crash(expression: str) -> None:
    """The evaluator converts values recursively in native code: 100,000 levels would overflow
    the stack and end the process (a segmentation fault), so the depth is checked first."""
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(LookupError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        run(expression, input=deep if expression == "size(input)" else {"v": deep})
    assert run(expression, input=[[]] if expression == "size(input)" else {"v": [[]]}) == 1


@pytest.mark.parametrize("expression", ["input.(", "1 +", '"abc', "", "input['a"])
def test_an_expression_that_does_not_compile_is_a_value_error_naming_it_once(expression: str) -> None:
    with pytest.raises(ValueError, match="is not a valid CEL expression: ERROR") as info:
        compile_cel(expression)
    assert str(info.value).startswith(f"{expression!r} is not a valid CEL expression")
    assert "Failed to parse expression" not in str(info.value)


def test_a_bad_key_fails_registration_naming_where() -> None:
    with pytest.raises(RegistrationError, match=r"workflow 'wf': singleton: key 'input\.\(' is not a valid CEL"):
        parse_key("workflow 'wf': singleton", "input.(")


def test_a_program_is_compiled_once_and_evaluated_many_times() -> None:
    key = parse_key("workflow 'wf': singleton", '"user:" + input.user')
    assert [evaluate_key(key, "wf", {"user": name}, "r", "wf") for name in ("a", "b")] == ["user:a", "user:b"]


# -- how a value becomes a key ------------------------------------------------------------------
@pytest.mark.parametrize("value", [7, 1.5, True, None, "", ["a"], {"a": "b"}])
def test_a_key_that_is_not_a_non_empty_string_refuses_the_start(value: Any) -> None:
    key = parse_key("workflow 'wf': concurrency", "input.v")
    with pytest.raises(InvalidInput, match="must evaluate to a non-empty string"):
        evaluate_key(key, "workflow 'wf': concurrency", {"v": value}, "r", "wf")


def test_a_key_that_fails_on_the_input_refuses_the_start_with_cels_reason() -> None:
    key = parse_key("workflow 'wf': concurrency", "input.account")
    with pytest.raises(InvalidInput, match=r"key 'input\.account' failed on this input: no such key: 'account'"):
        evaluate_key(key, "workflow 'wf': concurrency", {}, "r", "wf")


def test_a_quota_key_is_a_string_or_null_and_anything_else_is_an_invalid_quota() -> None:
    key = CelKey.compile("has(input.t) ? input.t : null")
    assert (key({"t": "acme"}), key({})) == ("acme", None)
    assert type(key({"t": "acme"})) is str
    with pytest.raises(InvalidQuota, match="must give a string or null, got 7"):
        key({"t": 7})
    with pytest.raises(InvalidQuota, match=r"failed on this input: no such key: 't'"):
        CelKey.compile("input.t")({})
    with pytest.raises(InvalidQuota, match="is not a valid CEL expression"):
        CelKey.compile("input.(")


# -- only what the expression reads is converted, and that changes no result -------------------
@pytest.mark.parametrize(
    ("expression", "fields"),
    [
        ("input.customer_id", {"customer_id"}),
        ('input.user_id + "-" + input . import_id', {"user_id", "import_id"}),
        ("has(input.t) ? input.t : null", {"t"}),
        ("input.nested.deep.x", {"nested"}),
        ("input.tags[0]", {"tags"}),
        ('input.tags.exists(t, t == "a")', {"tags"}),
        ('"input.q" + input.user', {"q", "user"}),  # a literal can only widen the cut
        ('"external-api"', set()),
        ('input["dash-key"]', None),
        ("size(input)", None),
        ('"k" in input', None),
        ('input.exists(k, k == "a")', None),
        ("input.size()", None),
        ('[{"x": 1}].map(input, input.x) + [input]', None),
        ('"the input"', None),
    ],
)
def test_the_fields_an_expression_reads(expression: str, fields: set[str] | None) -> None:
    assert fields_read(expression, "input") == (None if fields is None else frozenset(fields))


TRICKY = [
    'input.exists(k, k == "user")',
    "size(input)",
    "input.size()",
    'has(input.missing) ? input.missing : "none"',
    'input.user + "-" + input . n.string()',
    '[{"user": "x"}].map(input, input.user)',
    '"user" in input',
    "input.nested.k",
    "input",
]


@pytest.mark.parametrize(
    "expression",
    [expression for expression, _ in PROJECT_KEYS] + TRICKY,
)
def test_cutting_the_input_to_the_fields_read_changes_no_result(expression: str) -> None:
    compiled = compile_cel(expression)
    variables = {"input": DATA, "run_id": "r-1", "workflow": "wf"}
    try:
        whole = compiled.program.execute(variables)
    except Exception:  # noqa: BLE001 - over the whole input it fails, so it must over the cut one
        with pytest.raises(LookupError):
            evaluate_cel(compiled, **variables)
        return
    assert evaluate_cel(compiled, **variables) == whole
