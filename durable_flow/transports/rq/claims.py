"""The `rq` transport's claim book and doorbell: a popped job is always somewhere a poller can
find it.

A worker takes jobs in two round trips: it pops ids off the tier lists (with the jobs' data),
then creates their RQ `Execution`s in the `StartedJobRegistry` (RQ builds them in Python). A
worker killed, or cut off from Redis, between the two would leave the job in no list and no
registry, back only after `REDISPATCH_AFTER_S`. So the pop is a script that, in the same atomic
step, books the ids as held by the worker, and the registration's MULTI strikes them from the book:
a job is at every moment in a tier list, the book, or the started registry. The poller hands a
dead worker's booked ids back (`release`) as soon as its heartbeat lapses, as it does with the
dead worker's started-registry entries.

A script cannot block, so a worker with nothing to do waits on a doorbell instead of on the
tier lists: durable_flow's producers push one bell per job in the enqueue's own MULTI, and an
idle worker `BLPOP`s it, then runs the pop script. Bells track queued jobs: a pop consumes one
per job it takes (less the bell that woke it), and a pop that finds every tier empty clears
them, so a bell rarely wakes a worker for nothing. A job pushed without a bell (RQ's own
retries, a requeue from the failed registry, a plain `enqueue`) is found when the idle wait
times out, at most `WorkerRuntime.idle_wait_s` later.

Key layout (under `rq:`, so whatever clears RQ's keys clears these too)::

    rq:durable_flow:<queue>:claimed   hash  job id -> "<worker name>\\t<tier list key>"
    rq:durable_flow:<queue>:doorbell  list  one "1" per job enqueued, capped at DOORBELL_CAP
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

#: Most bells kept: past this many queued jobs, workers are busy and pop without waiting.
DOORBELL_CAP = 1000

# KEYS: the tier lists high, normal, low; the book; the doorbell.
# ARGV: how many to pop, the worker, how many bells this worker already took (0 or 1), RQ's job
# key prefix. Returns the tier's key, the ids, and each job's hash (read here: no second round
# trip for the job data; empty for a job deleted or expired while queued).
_POP = """
local limit = tonumber(ARGV[1])
for i = 1, 3 do
  local ids = redis.call('LPOP', KEYS[i], limit)
  if ids then
    local owner = ARGV[2] .. '\\t' .. KEYS[i]
    local fields = {}
    for _, id in ipairs(ids) do
      fields[#fields + 1] = id
      fields[#fields + 1] = owner
    end
    redis.call('HSET', KEYS[4], unpack(fields))
    local extra = #ids - tonumber(ARGV[3])
    if extra > 0 then
      redis.call('LTRIM', KEYS[5], extra, -1)
    end
    local jobs = {}
    for j, id in ipairs(ids) do
      jobs[j] = redis.call('HGETALL', ARGV[4] .. id)
    end
    return {KEYS[i], ids, jobs}
  end
end
redis.call('DEL', KEYS[5])
return false
"""

# KEYS: the book; the doorbell. ARGV: the bell cap, then (job id, booked value, tier list key)
# triples. A job is pushed back only if the book still holds it with that value: of two
# releasers (two pollers; a poller and the worker itself) exactly one pushes it.
_RELEASE = """
local released = 0
for i = 2, #ARGV, 3 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('LPUSH', ARGV[i + 2], ARGV[i])
    redis.call('RPUSH', KEYS[2], '1')
    released = released + 1
  end
end
if released > 0 then
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[1]), -1)
end
return released
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Popped(NamedTuple):
    """What one pop took: the tier list it came from, the job ids, and each job's stored hash
    (as `HGETALL` gives it; empty for a job deleted or expired while queued)."""

    tier_key: str
    ids: list[str]
    jobs: list[dict[bytes, bytes]]


class ClaimBook:
    """The book of popped-but-unregistered jobs of one durable_flow queue, and its doorbell."""

    def __init__(self, connection: Redis, queue_name: str, tier_keys: list[str], job_prefix: str) -> None:
        self.connection = connection
        self.tier_keys = tier_keys  # high, normal, low
        self.job_prefix = job_prefix  # RQ's `Job.redis_job_namespace_prefix`
        self.key = f"rq:durable_flow:{queue_name}:claimed"
        self.doorbell = f"rq:durable_flow:{queue_name}:doorbell"
        self._pop = connection.register_script(_POP)
        self._release = connection.register_script(_RELEASE)

    @staticmethod
    def owner(worker: str, tier_key: str) -> str:
        """The book's value for a job `worker` popped from `tier_key`."""
        return f"{worker}\t{tier_key}"

    def ring(self, pipeline: Pipeline) -> None:
        """One bell for one job pushed in this pipeline (after the push, in the same MULTI)."""
        pipeline.rpush(self.doorbell, "1")
        pipeline.ltrim(self.doorbell, -DOORBELL_CAP, -1)

    def pop(self, worker: str, limit: int, bells_taken: int = 0) -> Popped | None:
        """Pop up to `limit` jobs from the first non-empty tier and book them for `worker`, or
        None if every tier is empty."""
        keys = [*self.tier_keys, self.key, self.doorbell]
        popped: Any = self._pop(keys=keys, args=[limit, worker, bells_taken, self.job_prefix])
        if not popped:
            return None
        key, ids, jobs = popped
        hashes = [dict(zip(flat[::2], flat[1::2], strict=True)) for flat in jobs]
        return Popped(_text(key), [_text(raw) for raw in ids], hashes)

    def wait(self, timeout_s: float) -> bool:
        """Block until a bell rings (True) or `timeout_s` passes (False)."""
        return self.connection.blpop([self.doorbell], timeout=timeout_s) is not None

    def strike(self, ids: Iterable[str], pipeline: Pipeline) -> None:
        """Registered (in this pipeline's MULTI): the ids leave the book."""
        ids = list(ids)
        if ids:
            pipeline.hdel(self.key, *ids)

    def release(self, entries: Iterable[tuple[str, str, str]]) -> int:
        """Push booked jobs back at the head of their tier list, each (job id, booked value,
        tier key) only if still booked so; returns how many were pushed back."""
        args: list[Any] = [DOORBELL_CAP]
        for entry in entries:
            args.extend(entry)
        if len(args) == 1:
            return 0
        return int(self._release(keys=[self.key, self.doorbell], args=args))

    def release_own(self, worker: str, tier_key: str, ids: Iterable[str]) -> int:
        """A live worker gives back ids it popped but could not register."""
        owner = self.owner(worker, tier_key)
        return self.release((job_id, owner, tier_key) for job_id in ids)

    def release_dead(self, dead_workers: set[str]) -> int:
        """Hand back every job booked by one of `dead_workers` (the poller's upkeep)."""
        booked = self.connection.hgetall(self.key)
        entries = []
        for raw_id, raw_owner in booked.items():
            owner = _text(raw_owner)
            worker, _, tier_key = owner.partition("\t")
            if worker in dead_workers:
                entries.append((_text(raw_id), owner, tier_key))
        return self.release(entries)
