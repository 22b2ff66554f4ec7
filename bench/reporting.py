"""What every bench shares: its figures written as one JSON document, and progress lines on stderr.

    parser = argparse.ArgumentParser(...)
    reporting.add_json_option(parser, "history")           # --json PATH (default var/bench/history.json)
    ...
    with reporting.progress("inserting history", total=100_000, unit="runs") as shown:
        for offset in range(0, 100_000, 5000):
            ...
            shown.advance(5000)
    ...
    reporting.write_json(
        "history",
        {"empty_wf_s": empties, "loaded_wf_s": loadeds, "ratio": ratio},
        path=args.json,
        summary=[f"ratio with history / empty, median of the rounds: {ratio:.2f}"],
        targets=[reporting.target("ratio with history / empty", ratio, ">=", 0.9)],
    )

The JSON document is what `bench/run_all.py` reads (never the printed text, which stays for a
reader): `bench` (its name), `when` (UTC, ISO 8601), `argv`, `machine` (CPUs, Python, Django,
PostgreSQL and Redis server versions, load average), `figures` (the bench's own: medians, worst
rounds, ratios, per-round values), `summary` (a few lines for the table of
docs/benchmarks.md) and `targets` (each a figure, its bound and whether it was met).

`progress` prints a line to stderr at most every `every_s` seconds (rows loaded, rounds done,
elapsed, an estimate of the time left), and, used as a context manager, keeps printing the
elapsed time while nothing updates it (one long SQL statement, a child process), so a long
set-up is never silent for more than about ten seconds. stdout is left to the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
#: Where a bench run on its own writes its JSON: var/bench/<name>.json (var/ is not committed).
DEFAULT_DIR = ROOT / "var" / "bench"
#: The document's layout; bumped when a key changes meaning, so readers can refuse old files.
SCHEMA = 1
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda value, bound: value >= bound,
    "<=": lambda value, bound: value <= bound,
    ">": lambda value, bound: value > bound,
    "<": lambda value, bound: value < bound,
    "==": lambda value, bound: value == bound,
}


class ReportError(ValueError):
    """A JSON document that is not a bench report (missing keys, another schema)."""


# -- the JSON document ----------------------------------------------------------------------------
def add_json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--json PATH`: where the figures go (default var/bench/<name>.json)."""
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=Path,
        default=None,
        help=f"write the figures as JSON to PATH (default var/bench/{name}.json)",
    )


def default_path(name: str) -> Path:
    return DEFAULT_DIR / f"{name}.json"


def target(name: str, value: float | None, op: str, bound: float) -> dict[str, Any]:
    """One target: `target("ratio at 100,000 parked", 1.07, "<", 1.5)` -> met True. A figure that
    could not be measured (None, NaN) never meets its target."""
    if op not in OPERATORS:
        raise ValueError(f"unknown operator {op!r}; use one of {', '.join(OPERATORS)}")
    measured = value is not None and not (isinstance(value, float) and math.isnan(value))
    return {"name": name, "value": value, "op": op, "bound": bound, "met": measured and OPERATORS[op](value, bound)}


def document(
    name: str,
    figures: dict[str, Any],
    *,
    summary: Sequence[str] = (),
    targets: Iterable[dict[str, Any]] = (),
    argv: Sequence[str] | None = None,
    about: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of one bench run (see the module's docstring)."""
    return {
        "schema": SCHEMA,
        "bench": name,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "machine": machine() if about is None else about,
        "figures": figures,
        "summary": list(summary),
        "targets": list(targets),
    }


def write_json(
    name: str,
    figures: dict[str, Any],
    *,
    path: Path | None = None,
    summary: Sequence[str] = (),
    targets: Iterable[dict[str, Any]] = (),
    about: dict[str, Any] | None = None,
) -> Path:
    """Write the bench's document to `path` (default var/bench/<name>.json), whole or not at all
    (a temporary file renamed over it); return the path. NaN and infinities become null: JSON
    has neither."""
    path = Path(path) if path is not None else default_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = document(name, figures, summary=summary, targets=targets, about=about)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    os.replace(partial, path)
    print(f"figures written to {_shown(path)}", file=sys.stderr, flush=True)
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A bench's document from `path`, checked: `ReportError` if it is not one of this schema."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: a JSON {type(doc).__name__}, not an object")
    if doc.get("schema") != SCHEMA:
        raise ReportError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA}")
    missing = [key for key in ("bench", "when", "figures", "summary", "targets") if key not in doc]
    if missing:
        raise ReportError(f"{path}: missing {', '.join(missing)}")
    if not isinstance(doc["figures"], dict) or not isinstance(doc["summary"], list):
        raise ReportError(f"{path}: figures must be an object and summary a list")
    for entry in doc["targets"]:
        if not isinstance(entry, dict) or not {"name", "value", "op", "bound", "met"} <= entry.keys():
            raise ReportError(f"{path}: a target needs name, value, op, bound and met: {entry!r}")
    return doc


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# -- the machine ---------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """What the figures were measured on (a service that does not answer reads None)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "django": _version("django"),
        "postgres": _postgres_version(),
        "redis": _redis_version(),
        "load_average": [round(value, 2) for value in load] if load else None,
    }


def _proc_field(path: str, key: str) -> str | None:
    """The value of `key: value` in a /proc file (Linux), None elsewhere."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        field, _, value = line.partition(":")
        if field.strip() == key:
            return value.strip()
    return None


def _cpu_model() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal")  # "24601234 kB"
    return round(int(total.split()[0]) / 1024 / 1024, 1) if total else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _postgres_version() -> str | None:
    try:
        import psycopg
    except ImportError:
        return None
    try:
        with psycopg.connect(PG_ADMIN_URL, connect_timeout=2) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error:
        return None
    return str(row[0]) if row else None


def _redis_version() -> str | None:
    try:
        import redis
    except ImportError:
        return None
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()
    except (redis.RedisError, OSError, KeyError):
        return None


# -- progress -------------------------------------------------------------------------------------
class Progress:
    """Throttled progress lines for one long phase, on stderr.

    `update(done)` / `advance(n)` record how far it got and print a line when `every_s` have
    passed since the last one ("loading runs: 40,000/100,000 runs (40%), 12 s, ~18 s left").
    As a context manager it prints a first line, a heartbeat while nothing updates it, and a
    last line with the time taken. `clock` and `stream` are there for tests."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        *,
        every_s: float = 5.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.every_s = every_s
        self.stream = stream
        self.clock = clock
        self.done = 0
        self.started = clock()
        self.last_shown = self.started
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def update(self, done: int) -> None:
        """`done` of `total` so far; prints if the last line is `every_s` old."""
        with self._lock:
            self.done = done
            self._show_if_due()

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.done += count
            self._show_if_due()

    def line(self) -> str:
        """The progress line as of now."""
        elapsed = self.clock() - self.started
        unit = f" {self.unit}" if self.unit else ""
        parts = [f"{self.label}:"]
        if self.total:
            parts.append(f"{self.done:,}/{self.total:,}{unit} ({self.done / self.total:.0%}),")
        elif self.done:
            parts.append(f"{self.done:,}{unit},")
        parts.append(f"{elapsed:.0f} s")
        if self.total and 0 < self.done < self.total:
            parts[-1] += f", ~{elapsed * (self.total - self.done) / self.done:.0f} s left"
        return " ".join(parts)

    def _show_if_due(self) -> None:
        now = self.clock()
        if now - self.last_shown >= self.every_s:
            self._print(self.line())
            self.last_shown = now

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def _beat(self) -> None:
        while not self._stopped.wait(self.every_s / 2):
            with self._lock:
                self._show_if_due()

    def __enter__(self) -> Progress:
        total = f" ({self.total:,}{f' {self.unit}' if self.unit else ''})" if self.total else ""
        self._print(f"{self.label}{total} ...")
        self._heartbeat = threading.Thread(target=self._beat, name=f"progress: {self.label}", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        elapsed = self.clock() - self.started
        count = f" {self.done:,} {self.unit}".rstrip() if self.done else ""
        outcome = "failed after" if kind is not None else "done in"
        self._print(f"{self.label}:{count} {outcome} {elapsed:.1f} s")


def progress(label: str, total: int | None = None, unit: str = "", *, every_s: float = 5.0) -> Progress:
    """A `Progress` on stderr: `with progress("parking runs", total=100_000, unit="runs") as shown:`."""
    return Progress(label, total, unit, every_s=every_s)


def log(text: str) -> None:
    """One line of what the bench is doing now, on stderr (stdout is for the figures)."""
    print(text, file=sys.stderr, flush=True)
