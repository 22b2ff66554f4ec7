"""A redis-server a test owns: started on a free port, killed and restarted at will.

Killing it disturbs nobody else's Redis. Without a data directory it keeps nothing across a
restart; with one it writes an append-only file fsynced on every write (`appendfsync always`),
so a SIGKILL loses no acknowledged write: an outage of the server, not a loss of its data.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.conftest import wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnRedis:
    """A redis-server this test starts, kills and restarts on the same port."""

    def __init__(self, port: int, data_dir: Path | None = None) -> None:
        self.port = port
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 1) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        persistence = ["--save", "", "--appendonly", "no"]
        if self.data_dir is not None:
            persistence = ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *persistence],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = Redis(port=self.port)
        wait_for(lambda: self._pings(client), timeout=30, what="the test's redis-server to answer")

    @staticmethod
    def _pings(client: Redis) -> bool:
        try:
            return bool(client.ping())
        except (RedisConnectionError, OSError):  # not up yet
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
