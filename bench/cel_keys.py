#!/usr/bin/env python
"""CEL key evaluation: µs per evaluation of the keys users write (the reference documents'
examples and the project's own), through the project's evaluator (`common-expression-language`,
the Rust `cel` crate) against the pure-Python `cel-python` it replaced, measured in the same run.

    .venv/bin/python bench/cel_keys.py            # ~15 s of CPU
    .venv/bin/python bench/cel_keys.py --quick    # ~3 s of CPU
    .venv/bin/python bench/cel_keys.py --json P   # the figures as JSON to P too (bench/reporting.py)

Each expression is compiled once by each library (as registration does), then evaluated over a
start's variables (`input`, `run_id`, `workflow`) in rounds that alternate which library goes
first, so drift on a busy machine hits both alike; the clock is the thread's CPU time. Per
expression: the median and the worst round's µs per evaluation of each, and the ratio before /
after of the medians and of the worst rounds; "uncut" is the same Rust evaluator handed the
whole input (what cutting it to the fields the expression reads saves). Two inputs: a small one
(a dozen fields, what a key usually reads) and a large one (a few hundred values: cel-python
converts the whole input on every start, whatever the key reads). Before timing, every
expression must give the same key from both libraries. `cel-python` is a dev
dependency; without it, only the project's figures print.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from durable_flow.definitions.cel import compile_cel, evaluate_cel  # noqa: E402

EXPRESSIONS = [
    "input.customer_id",
    'input.user_id + "-" + input.import_id',
    '"external-api"',
    '"user:" + input.user',
    'has(input.tenant_id) ? "tenant:" + input.tenant_id : null',
    'input.account + "-" + workflow',
]

SMALL = {
    "customer_id": "cust-7",
    "user_id": "u-19",
    "import_id": "imp-2026-12",
    "user": "ann",
    "tenant_id": "acme",
    "account": "acct-1",
    "amount": 1250,
    "currency": "EUR",
    "urgent": False,
    "tags": ["csv", "nightly"],
    "meta": {"source": "upload", "size": 18234},
}
LARGE = {
    **SMALL,
    "rows": [{"line": i, "sku": f"sku-{i}", "qty": i % 7, "price": i * 1.25} for i in range(60)],
    "notes": {f"note_{i}": f"text {i}" for i in range(40)},
}
INPUTS = {"small": SMALL, "large": LARGE}
VARIABLES = {"run_id": "run-0001", "workflow": "imports.process"}

Evaluate = Callable[[], Any]


def after(expression: str, input: Any) -> Evaluate:
    program = compile_cel(expression)
    return lambda: evaluate_cel(program, input=input, **VARIABLES)


def uncut(expression: str, input: Any) -> Evaluate:
    """The same bindings handed every variable whole: what the cut to the fields read saves."""
    program = compile_cel(expression).program
    variables = {"input": input, **VARIABLES}
    return lambda: program.execute(variables)


def before(expression: str, input: Any) -> Evaluate | None:
    """The evaluator the keys used before: `cel-python`, as the project's adapter called it."""
    try:
        import celpy
    except ImportError:
        return None
    environment = celpy.Environment()
    program = environment.program(environment.compile(expression))

    def evaluate() -> Any:
        activation = {name: celpy.json_to_cel(value) for name, value in {"input": input, **VARIABLES}.items()}
        value = program.evaluate(activation)
        return None if value is None else str(value)

    return evaluate


def per_evaluation_us(evaluate: Evaluate, count: int) -> float:
    # CPU time of this thread: an evaluation is pure computation, and on a shared machine the
    # wall clock would also count the time other processes held the core.
    started = time.thread_time()
    for _ in range(count):
        evaluate()
    return (time.thread_time() - started) / count * 1e6


def calibrated(evaluate: Evaluate, seconds: float) -> int:
    """How many evaluations fill about `seconds`, so a fast evaluator is not timed on a few µs."""
    return max(10, int(seconds / (per_evaluation_us(evaluate, 10) / 1e6)))


def measure(rounds: int, seconds: float) -> list[dict[str, Any]]:
    rows = []
    for size, payload in INPUTS.items():
        for expression in EXPRESSIONS:
            new, old = after(expression, payload), before(expression, payload)
            if old is not None and old() != new():
                raise SystemExit(f"{expression!r} over the {size} input: cel-python {old()!r}, cel {new()!r}")
            evaluators = {"after": new, "uncut": uncut(expression, payload), "before": old}
            counts = {name: calibrated(evaluate, seconds) for name, evaluate in evaluators.items() if evaluate}
            timings: dict[str, list[float]] = {name: [] for name in counts}
            for number in range(rounds):
                order = list(counts) if number % 2 == 0 else list(reversed(counts))
                for name in order:
                    timings[name].append(per_evaluation_us(evaluators[name], counts[name]))  # type: ignore[arg-type]
            rows.append({"input": size, "expression": expression, "key": new(), **summarise(timings)})
    return rows


def summarise(timings: dict[str, list[float]]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "after_median_us": statistics.median(timings["after"]),
        "after_worst_us": max(timings["after"]),
        "uncut_median_us": statistics.median(timings["uncut"]),
    }
    if "before" in timings:
        row["before_median_us"] = statistics.median(timings["before"])
        row["before_worst_us"] = max(timings["before"])
        row["ratio_median"] = row["before_median_us"] / row["after_median_us"]
        # The worst round's ratio: the smallest speed-up any one round showed.
        row["ratio_worst_round"] = min(b / a for b, a in zip(timings["before"], timings["after"], strict=True))
    return row


def report(rows: list[dict[str, Any]]) -> None:
    compared = "before_median_us" in rows[0]
    if not compared:
        print("cel-python is not installed (a dev dependency): the project's figures only\n")
    print(f"{'input':<6} {'expression':<58} {'after µs med/worst':>19} {'uncut med':>9}", end="")
    print(f" {'before µs med/worst':>20} {'ratio med':>9} {'worst rnd':>9}" if compared else "")
    for row in rows:
        line = f"{row['input']:<6} {row['expression']:<58} {row['after_median_us']:>9.1f}/{row['after_worst_us']:<9.1f}"
        line += f" {row['uncut_median_us']:>9.1f}"
        if compared:
            line += f" {row['before_median_us']:>9.1f}/{row['before_worst_us']:<10.1f}"
            line += f" {row['ratio_median']:>8.1f}x {row['ratio_worst_round']:>8.1f}x"
        print(line)
    if compared:
        ratios = [row["ratio_median"] for row in rows]
        worst = min(row["ratio_worst_round"] for row in rows)
        print(
            f"\ncel (Rust) vs cel-python, µs per key evaluation: median ratio {statistics.median(ratios):.1f}x "
            f"(expressions from {min(ratios):.1f}x to {max(ratios):.1f}x), worst round {worst:.1f}x; "
            "every key identical from both"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and evaluations")
    reporting.add_json_option(parser, "cel_keys")
    options = parser.parse_args()
    rounds, seconds = (4, 0.01) if options.quick else (10, 0.03)
    rows = measure(rounds, seconds)
    print(f"{rounds} alternating rounds, each timing ~{seconds * 1000:.0f} ms of evaluations\n")
    report(rows)
    compared = [row for row in rows if "ratio_median" in row]
    summary, targets = [], []
    if compared:
        median = statistics.median(row["ratio_median"] for row in compared)
        summary.append(f"cel (Rust) vs cel-python, per key evaluation: median ratio {median:.1f}x")
        targets.append(reporting.target("median ratio cel-python / cel (Rust)", median, ">=", 1.0))
    reporting.write_json(
        "cel_keys",
        {"rounds": rounds, "seconds_per_timing": seconds, "rows": rows},
        path=options.json,
        summary=summary,
        targets=targets,
    )


if __name__ == "__main__":
    main()
