"""bench/capacity.py: its model's arithmetic, a quick run's report as run_all.py reads it, and
bench/cluster_admission.py's verdict line on a machine with too few cores for one."""

from __future__ import annotations

import shutil
from pathlib import Path

import capacity
import cluster_admission
import pytest
import run_all


def costs(**overrides: float) -> dict[str, float | bool]:
    row: dict[str, float | bool] = {"worker_cpu_us": 5000.0, "pg_cpu_us": 2500.0, "redis_cpu_us": 1000.0}
    row["uses_redis"] = True
    row.update(overrides)
    return row


def test_each_part_carries_a_second_over_its_cost_per_workflow() -> None:
    model = capacity.ceilings(costs(), pg_cores=2, admission_cpu_us=400.0)
    assert model["worker_core"] == pytest.approx(200)
    assert model["pg_core"] == pytest.approx(400)
    assert model["postgresql_primary"] == pytest.approx(800)
    assert model["redis_shard"] == pytest.approx(1000)
    assert model["redis_shard_admission_only"] == pytest.approx(2500)


def test_the_lower_ceiling_saturates_first_and_sizes_the_workers() -> None:
    small = capacity.ceilings(costs(), pg_cores=2, admission_cpu_us=None)
    assert (small["saturates_first"], small["ceiling_wf_s"]) == ("postgresql_primary", pytest.approx(800))
    assert small["worker_cores_at_ceiling"] == pytest.approx(4.0)
    big = capacity.ceilings(costs(), pg_cores=8, admission_cpu_us=None)
    assert (big["saturates_first"], big["ceiling_wf_s"]) == ("redis_shard", pytest.approx(1000))
    assert big["pg_cores_to_match_redis_shard"] == pytest.approx(2.5)


def test_a_shape_without_redis_has_no_redis_ceiling() -> None:
    model = capacity.ceilings(costs(uses_redis=False, redis_cpu_us=70.0), pg_cores=64, admission_cpu_us=None)
    assert "redis_shard" not in model
    assert model["saturates_first"] == "postgresql_primary"


def test_the_cluster_verdict_says_when_the_cores_are_too_few_for_one() -> None:
    short = cluster_admission.target_line(1.05, 1.10, cpus=2, clients=4)
    assert short.startswith("target: 2 masters / 1 >= 1.8x, 3 masters / 1 >= 2.5x: 1.05 / 1.10: MISSED")
    assert "no verdict on this machine: 2 CPUs for 3 masters + 4 clients" in short
    assert "not Redis Cluster" in short
    enough = cluster_admission.target_line(1.9, 2.7, cpus=8, clients=4)
    assert enough == "target: 2 masters / 1 >= 1.8x, 3 masters / 1 >= 2.5x: 1.90 / 2.70: met"


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="bench/capacity.py starts a redis-server")
def test_a_quick_run_writes_a_report_run_all_reads(tmp_path: Path) -> None:
    """Real Redis (its own server), PostgreSQL (its own database) and a real worker runtime."""
    argv = ["capacity.py", "--quick", "--decisions", "50", "--runs", "10", "--concurrency", "2"]
    result = run_all.run("capacity", argv, tmp_path)
    assert not result.failed, f"{result.problem}\n{result.errors}"
    assert result.report is not None
    figures = result.report["figures"]
    assert set(figures["redis_per_decision"]) == {
        f"{kind}: {op}" for kind in ("plain queue", "queue + step concurrency") for op in capacity.OPS
    }
    assert all(row["evalsha_calls"] >= 50 for row in figures["redis_per_decision"].values())
    assert all(row["server_cpu_us_per_decision"] > 0 for row in figures["redis_per_decision"].values())
    shapes = figures["shapes"]
    assert list(shapes) == [shape.name for shape in capacity.SHAPES]
    for row in shapes.values():
        assert row["runs"] == 10
        assert row["statements"] > 3 and row["round_trips"] > 1
        assert row["pg_cpu_us"] > 0 and row["worker_cpu_us"] > 0
        assert row["model"]["ceiling_wf_s"] > 0
    assert not shapes["db"]["uses_redis"] and "redis_shard" not in shapes["db"]["model"]
    for name in ("rq + redis", "rq + redis, step concurrency"):
        calls = shapes[name]["admission_script_calls"]
        assert calls["admit"] == calls["release"] == 1.0, calls
        assert shapes[name]["redis_calls_by_command"]["evalsha"] >= 4, shapes[name]["redis_calls_by_command"]
        assert 0 < shapes[name]["model"]["redis_shard"] < shapes[name]["model"]["redis_shard_admission_only"]
        assert shapes[name]["redis_cpu_us"] > 0
    assert [entry["met"] for entry in result.report["targets"]] == [True] * len(capacity.SHAPES)
    assert any("saturates first" in line for line in run_all.headlines(result))
