"""The reference pages list everything they refer to: docs/python-api.md every public name (a
new API function or `ctx` method without an entry fails here), docs/settings.md every settings
key (`DURABLE_FLOW`'s, each backend's options, the adaptive `CONCURRENCY` fields,
`DASHBOARD_BURST`'s) and every system-check id, docs/metrics.md every Prometheus metric."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from django.utils.module_loading import import_string

import durable_flow
from durable_flow.config.concurrency import ADAPTIVE_OPTIONS
from durable_flow.config.options import Configurable, Option, Table
from durable_flow.config.settings import ADMISSION_BACKENDS, SETTINGS_OPTIONS, TRANSPORT_BACKENDS
from durable_flow.engine.context import WorkflowContext
from durable_flow_dashboard.flow import BURST_OPTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def documented_names() -> set[str]:
    """The names the page gives a heading of their own (`### \\`name\\``)."""
    return set(re.findall(r"^#{2,4} `([\w.]+)`", PAGE.read_text(), flags=re.MULTILINE))


def code_names() -> set[str]:
    """Every name written as inline code on the page (a table row of an exception, say)."""
    return set(re.findall(r"`([\w.]+)`", PAGE.read_text()))


def context_members() -> list[str]:
    """The public methods and properties of `WorkflowContext`, as `ctx.<name>`."""
    return [
        f"ctx.{name}"
        for name, member in inspect.getmembers(WorkflowContext)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    ]


@pytest.mark.parametrize("name", durable_flow.__all__)
def test_every_exported_name_is_documented(name: str) -> None:
    assert name in documented_names() | code_names(), f"docs/python-api.md does not document {name!r}"


@pytest.mark.parametrize("name", context_members())
def test_every_context_method_has_a_heading(name: str) -> None:
    assert name in documented_names(), f"docs/python-api.md has no heading for {name!r}"


def test_every_api_function_has_a_heading() -> None:
    missing = sorted(durable_flow.API - documented_names())
    assert not missing, f"docs/python-api.md has no heading for {missing}"


# docs/settings.md: every key a setting declares, and every system-check id.

ROOT = PAGE.parents[1]
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
METRICS_PAGE = ROOT / "docs" / "metrics.md"


def inline_code(page: Path) -> set[str]:
    """Everything the page writes as inline code."""
    return set(re.findall(r"`([^`\n]+)`", page.read_text()))


def table_keys(where: str, declared: Mapping[str, Option]) -> list[tuple[str, str]]:
    """`(path, key)` for every key of an option table and of the tables nested in it."""
    keys = []
    for key, option in declared.items():
        keys.append((f'{where}["{key}"]', key))
        if isinstance(option.validate, Table):
            keys.extend(table_keys(f'{where}["{key}"]', option.validate.declared))
    return keys


def declared_settings() -> list[tuple[str, str]]:
    """Every key durable_flow and its dashboard read from settings: `DURABLE_FLOW`'s (with its
    sections), each built-in backend's `OPTIONS` (walked through the classes the aliases name),
    the adaptive `CONCURRENCY` fields and `DASHBOARD_BURST`'s."""
    keys = table_keys("DURABLE_FLOW", SETTINGS_OPTIONS)
    for setting, aliases in (("ADMISSION", ADMISSION_BACKENDS), ("TRANSPORT", TRANSPORT_BACKENDS)):
        for alias, path in aliases.items():
            cls = import_string(path)
            assert issubclass(cls, Configurable), path
            keys.extend(table_keys(f'DURABLE_FLOW["{setting}"] ({alias})', cls.OPTIONS))
    keys.extend(table_keys('DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]', ADAPTIVE_OPTIONS))
    keys.extend(table_keys("DASHBOARD_BURST", BURST_OPTIONS))
    return keys


@pytest.mark.parametrize(("path", "key"), declared_settings(), ids=lambda value: value)
def test_every_setting_is_documented(path: str, key: str) -> None:
    assert key in inline_code(SETTINGS_PAGE), f"docs/settings.md does not document {path} (as `{key}`)"


def test_the_walk_finds_the_backends_options() -> None:
    """The walk reaches into every backend and nested table: a key of each is among the found."""
    found = {path for path, _ in declared_settings()}
    for path in (
        'DURABLE_FLOW["POLLER"]["SAMPLE_RETENTION_S"]',
        'DURABLE_FLOW["ADMISSION"] (redis)["INSTANCE_TTL_MS"]',
        'DURABLE_FLOW["TRANSPORT"] (db)["VISIBILITY_TIMEOUT_S"]',
        'DURABLE_FLOW["TRANSPORT"] (rq)["EAGER_STEPS"]',
        'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]["tick_ms"]',
        'DASHBOARD_BURST["SIZE"]',
    ):
        assert path in found


#: A check id written out in full: `durable_flow.E001`, `durable_flow_dashboard.W002`,
#: `durable_flow.tasks.E001`.
FULL_CHECK_ID = re.compile(r"\bdurable_flow(?:_dashboard|\.tasks)?\.[EWIC]\d{3}\b")
#: A module that builds its ids from a prefix and a bare code: `id=f"durable_flow.{check_id}"`.
CHECK_ID_PREFIX = re.compile(r"""\bid=f["'](durable_flow\w*)\.\{\w+\}["']""")
BARE_CHECK_ID = re.compile(r"""["']([EWIC]\d{3})["']""")


def check_ids() -> set[str]:
    """Every system-check id the apps' sources can emit: the ids written out in full, and in a
    module that prefixes bare codes (`_error(message, "E004")`), each quoted code with its prefix."""
    ids: set[str] = set()
    for source in [*ROOT.joinpath("durable_flow").rglob("*.py"), *ROOT.joinpath("dashboard").rglob("*.py")]:
        text = source.read_text()
        ids |= set(FULL_CHECK_ID.findall(text))
        for prefix in set(CHECK_ID_PREFIX.findall(text)):
            ids |= {f"{prefix}.{code}" for code in BARE_CHECK_ID.findall(text)}
    return ids


def test_the_check_ids_are_found() -> None:
    """Each way an id is built is seen: a prefixed code, a literal id, the dashboard's, the tasks backend's."""
    assert {
        "durable_flow.E004",
        "durable_flow.W002",
        "durable_flow_dashboard.E005",
        "durable_flow.tasks.E001",
    } <= check_ids()


@pytest.mark.parametrize("check_id", sorted(check_ids()))
def test_every_check_id_is_documented(check_id: str) -> None:
    assert check_id in inline_code(SETTINGS_PAGE), f"docs/settings.md does not document `{check_id}`"


# docs/metrics.md: every metric the collector exposes.

#: The metric families, by the class that builds them.
METRIC_BUILDERS = {"GaugeMetricFamily", "CounterMetricFamily", "HistogramMetricFamily"}
#: The tables of counted families (`store.metric_counts` keeps them), built in a loop each.
COUNTED_TABLES = {"COUNTERS": "_total", "HISTOGRAMS": ""}


def metric_names() -> list[str]:
    """The exposed name of every family `durable_flow.contrib.metrics` builds: the first argument
    of each family built by name, and each entry of the counter and histogram tables, with
    `_total` for a counter (prometheus_client appends it)."""
    tree = ast.parse(ROOT.joinpath("durable_flow", "contrib", "metrics.py").read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in COUNTED_TABLES:
            assert node.value is not None
            names += [name + COUNTED_TABLES[node.target.id] for name, *_ in ast.literal_eval(node.value)]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in METRIC_BUILDERS:
            continue
        first = node.args[0]
        if isinstance(first, ast.Name):  # a table's entry, counted above
            continue
        assert isinstance(first, ast.Constant) and isinstance(first.value, str), ast.unparse(node)
        names.append(first.value + ("_total" if node.func.id == "CounterMetricFamily" else ""))
    return names


def test_the_metric_names_are_found() -> None:
    names = metric_names()
    assert len(names) == len(set(names))
    assert {
        "durable_flow_runs",
        "durable_flow_admissions_total",
        "durable_flow_runs_finished_total",
        "durable_flow_admission_wait_seconds",
        "durable_flow_tasks_unclaimed",
    } <= set(names)


@pytest.mark.parametrize("name", metric_names())
def test_every_metric_is_documented(name: str) -> None:
    assert name in inline_code(METRICS_PAGE), f"docs/metrics.md does not document `{name}`"
