"""A Redis Cluster the tests start themselves: three masters and three replicas on six
consecutive free ports (`REDIS_CLUSTER_PORT` fixes the first), in a temporary directory, for the
whole session.

`redis-server --cluster-enabled yes` on six ports, then `redis-cli --cluster create ...
--cluster-replicas 1`; ready once every node says `cluster_state:ok` and every master has its
replica. Torn down at the end of the session: the processes are killed and their files removed.
Skipped (with the reason) only when `redis-server` or `redis-cli` is not installed.

`OwnCluster.fail_over` kills a master (SIGKILL: a lost host) and waits for its replica to be
promoted, then starts the dead node again, which rejoins as the new master's replica: the next
test finds three masters with a replica each again.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.conftest import wait_for

#: The cluster bus of a node listens on its port + 10000 (Redis's rule).
BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_first_port(nodes: int = 6, low: int = 7100, high: int = 9000) -> int:
    """`REDIS_CLUSTER_PORT`, or the first port of `nodes` consecutive ports that are free, bus
    ports included, from a random start: test passes running side by side (`make test`'s
    shards) each start a cluster of their own without agreeing on ports beforehand."""
    if chosen := os.environ.get("REDIS_CLUSTER_PORT"):
        return int(chosen)
    start = random.randrange(low, high - nodes)
    for first in [*range(start, high - nodes, nodes), *range(low, start, nodes)]:
        ports = range(first, first + nodes)
        if all(_bindable(port) and _bindable(port + BUS_OFFSET) for port in ports):
            return first
    raise RuntimeError(f"no {nodes} consecutive free ports between {low} and {high} for a Redis Cluster")


NODE_TIMEOUT_MS = 1000
"""How long a master may be silent before its replica is promoted (the test's failover time)."""


class OwnCluster:
    """Six redis-server processes forming one cluster: 3 masters, 3 replicas."""

    def __init__(self, directory: Path, first_port: int | None = None, nodes: int = 6) -> None:
        self.directory = directory
        first_port = free_first_port(nodes) if first_port is None else first_port
        self.ports = [first_port + i for i in range(nodes)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A URL of one node: the client learns the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, port: int) -> Redis:
        return Redis(port=port, socket_timeout=5)

    def start_node(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(exist_ok=True)
        options = {
            "port": str(port),
            "bind": "127.0.0.1",
            "dir": str(node_dir),
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(NODE_TIMEOUT_MS),
            "save": "",
            "appendonly": "no",
        }
        argv = ["redis-server", *(part for name, value in options.items() for part in (f"--{name}", value))]
        self.procs[port] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self._pings(port), timeout=30, what=f"redis-server on port {port}")

    def _pings(self, port: int) -> bool:
        try:
            return bool(self.client(port).ping())
        except (RedisError, OSError):
            return False

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        self.wait_healthy()

    def start_masters(self) -> None:
        """Every node a master, no replica, the slots split evenly (any number of nodes, one
        included, which `redis-cli --cluster create` refuses): the benchmark's clusters."""
        for port in self.ports:
            self.start_node(port)
        share = 16384 // len(self.ports)
        for i, port in enumerate(self.ports):
            last = 16383 if i == len(self.ports) - 1 else (i + 1) * share - 1
            self.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            if i:
                self.client(port).execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        wait_for(
            lambda: self._healthy() and len(self.masters()) == len(self.ports),
            timeout=60,
            interval=0.2,
            what=f"a {len(self.ports)}-master Redis Cluster to report cluster_state:ok",
        )

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Each live master's port and its slot ranges, as the first answering node sees them."""
        for port in self.ports:
            try:
                shards = self.client(port).execute_command("CLUSTER", "SLOTS")
            except (RedisError, OSError):
                continue
            masters: dict[int, list[tuple[int, int]]] = {}
            for entry in shards:
                masters.setdefault(int(entry[2][1]), []).append((int(entry[0]), int(entry[1])))
            return masters
        return {}

    def master_of_slot(self, slot: int) -> int:
        """The port of the master serving `slot` now."""
        for port, ranges in self.masters().items():
            if any(lo <= slot <= hi for lo, hi in ranges):
                return port
        raise AssertionError(f"no master serves slot {slot}")

    def _healthy(self) -> bool:
        """Every running node says ok, knows three masters covering every slot, each with a replica."""
        try:
            for port, proc in self.procs.items():
                if proc.poll() is not None:
                    continue
                info = self.client(port).execute_command("CLUSTER", "INFO")
                info = info.decode() if isinstance(info, bytes) else info
                if "cluster_state:ok" not in info:
                    return False
            shards = self.client(self.ports[0]).execute_command("CLUSTER", "SLOTS")
        except (RedisError, OSError):
            return False
        return sum(int(e[1]) - int(e[0]) + 1 for e in shards) == 16384

    def wait_healthy(self, timeout: float = 60) -> None:
        """Every node says ok, every slot is served and every master has its replica."""
        wait_for(
            lambda: self._healthy() and self._replicas() == len(self.ports) // 2,
            timeout=timeout,
            interval=0.2,
            what="the Redis Cluster to report cluster_state:ok with a replica per master",
        )

    def fail_over(self, port: int, timeout: float = 60, on_kill: Callable[[], None] | None = None) -> int:
        """Kill master `port` (SIGKILL) and wait until a replica serves its slots; returns the
        new master's port. `on_kill` runs once the master is dead and before the promotion is
        awaited (a test reads there what the dead master can no longer change). The dead node is
        started again by `restart` (it rejoins as a replica)."""
        slot = self.masters()[port][0][0]
        self.procs[port].kill()
        self.procs[port].wait(10)
        if on_kill is not None:
            on_kill()

        def promoted() -> int | None:
            try:
                new = self.master_of_slot(slot)
            except AssertionError:
                return None
            return new if new != port and self._answers(new) else None

        new_master = wait_for(promoted, timeout=timeout, interval=0.1, what=f"a replica of {port} to be promoted")
        return int(new_master)

    def _answers(self, port: int) -> bool:
        try:
            info = self.client(port).execute_command("CLUSTER", "INFO")
        except (RedisError, OSError):
            return False
        return "cluster_state:ok" in (info.decode() if isinstance(info, bytes) else info)

    def restart(self, port: int) -> None:
        """Start a killed node again from its nodes.conf: it rejoins the cluster as a replica."""
        self.start_node(port)
        self.wait_healthy()

    def _replicas(self) -> int:
        try:
            shards = self.client(self.ports[0]).execute_command("CLUSTER", "SLOTS")
        except (RedisError, OSError):
            return 0
        return sum(len(e) - 3 for e in shards)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[OwnCluster]:
    """The session's three-master cluster (see the module docstring)."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Redis Cluster tests need {' and '.join(missing)} on PATH")
    directory = Path(tempfile.mkdtemp(prefix="df-redis-cluster-"))
    cluster = OwnCluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
