-- durable_flow fleet-wide admission: whether a lapsed heartbeat can mean a dead process.
--
-- Put in front of `admission.lua` and `heartbeat.lua` (see `redis.py`), so every script call and
-- every heartbeat counts as the server hearing the fleet.
--
-- An instance's heartbeat key lapses when its process stops beating: that is how a dead process's
-- slots come back. It lapses too when no process can beat: Redis was down, restarting or out of
-- reach for longer than what was left of the TTL, and every live process's key expired meanwhile
-- (expiry follows the wall clock, across a restart). Reclaiming then would hand the slots of steps
-- still running to other steps: a cap broken across the fleet. So the server keeps, in the hash
-- P:fleet, when it last heard any call ('heard') and since when it has heard calls with no silence
-- longer than half a TTL between them ('since'). A live process beats every ttl/4, so a longer
-- silence means the server was not hearing the fleet, and an outage that lets a live key lapse
-- lasts at least three quarters of a TTL (less a late beat's delay). A lapsed heartbeat is a
-- death only once the server has heard the fleet for a whole TTL: time for every live process to
-- beat again.
--
-- Always the server's clock (TIME), never a test's injected clock: it is measured against key
-- expiry, which follows the server's clock.

-- Record this call; return how long (ms) the server has heard the fleet without a silence.
local function fleet_heard_for(call, fleet_key, ttl)
  local t = call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local f = call('HMGET', fleet_key, 'heard', 'since')
  local heard, since = tonumber(f[1]), tonumber(f[2])
  if not heard or not since or now - heard > ttl / 2 then
    call('HSET', fleet_key, 'heard', now, 'since', now)
    return 0
  end
  if now - heard >= 100 then -- a write at most every 100 ms: 'heard' may lag, a silence only looks longer
    call('HSET', fleet_key, 'heard', now)
  end
  return now - since
end
