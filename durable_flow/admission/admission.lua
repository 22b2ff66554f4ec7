-- durable_flow fleet-wide admission: every read and write of one queue's accounting, atomically.
--
-- Loaded once by `durable_flow/admission/redis.py` (redis-py `register_script`, i.e. EVALSHA) and
-- dispatched on ARGV[1]: "admit" (the whole `policy.decide` rulebook), "release", "adopt",
-- "inflight".
-- The key layout and the ranking index are documented in redis.py's module docstring; the short
-- version of the index, needed to read this file:
--
--   P(p)  = 16 digits, 5e15 - priority     -> higher priority sorts first
--   A(a)  = 16 digits, arrival (fifo) or 9e15 - arrival (lifo) -> rightful arrival sorts first
--   S(s)  = 16 digits, serve number of the waiter's fairness key
--   KK(k) = 6-digit byte length .. k       -> a key as a self-delimiting prefix
--
--   fresh: P .. A .. ticket          every waiter (fairness "fifo"), or the waiters whose key was
--                                    never served (fairness "key": they all tie at served = -1)
--   grp:   P .. KK .. A .. ticket    fairness "key": waiters whose key has been served, grouped by
--                                    (priority, key); a group's members share the prefix P .. KK
--   gidx:  P .. S .. KK              one entry per non-empty group, in rank order of its key
--   kprio: KK .. P                   which priorities a served key has a group at (to re-rank it)
--   fkey:  KK .. P .. A .. ticket    the fresh waiters of a key (moved to grp at its first serve)
--
-- All are score-0 sorted sets read with ZLEXCOUNT / ZRANGEBYLEX, so every rank query is O(log N).
-- Lua numbers are doubles: integers are exact below 2^53, which every encoded value stays under.

local K_QUEUES, K_SLOTS, K_OWNERS, K_WAITERS, K_SEEN = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_FRESH, K_GRP, K_GIDX, K_KPRIO, K_FKEY = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_SERVED, K_META, K_MARKS, K_HEARTBEAT = KEYS[11], KEYS[12], KEYS[13], KEYS[14]

local op, queue, ticket = ARGV[1], ARGV[2], ARGV[3]
local me, hb_prefix, channel = ARGV[6], ARGV[10], ARGV[11]

local call = redis.call

local function now_ms()
  if ARGV[9] ~= '' then
    return tonumber(ARGV[9])
  end
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function pad(n) return string.format('%016d', n) end
local function penc(p) return pad(5e15 - p) end
local function aenc(a, lifo) if lifo then return pad(9e15 - a) end return pad(a) end
local function kenc(k) return string.format('%06d', #k) .. k end

-- The index's mode (fairness/order) is stored beside it, so release() and a re-registration with
-- another mode read the index the way it was built.
local function parse_mode(mode)
  mode = mode or 'fifo/fifo'
  return string.sub(mode, 1, 3) == 'key', string.sub(mode, -4) == 'lifo'
end

-- waiters hash value: "priority|arrival|fairness key" (the key last: it may contain '|').
local function parse_waiter(v)
  local i = string.find(v, '|', 1, true)
  local j = string.find(v, '|', i + 1, true)
  return tonumber(string.sub(v, 1, i - 1)), tonumber(string.sub(v, i + 1, j - 1)), string.sub(v, j + 1)
end

local function index_add(key_mode, lifo, t, p, a, k)
  local P, A = penc(p), aenc(a, lifo)
  if not key_mode then
    call('ZADD', K_FRESH, 0, P .. A .. t)
    return
  end
  local kk = kenc(k)
  local s = call('HGET', K_SERVED, k)
  if not s then
    call('ZADD', K_FRESH, 0, P .. A .. t)
    call('ZADD', K_FKEY, 0, kk .. P .. A .. t)
  else
    call('ZADD', K_GRP, 0, P .. kk .. A .. t)
    call('ZADD', K_GIDX, 0, P .. pad(tonumber(s)) .. kk)
    call('ZADD', K_KPRIO, 0, kk .. P)
  end
end

local function index_remove(key_mode, lifo, t, p, a, k)
  local P, A = penc(p), aenc(a, lifo)
  if not key_mode then
    call('ZREM', K_FRESH, P .. A .. t)
    return
  end
  local kk = kenc(k)
  local s = call('HGET', K_SERVED, k)
  if not s then
    call('ZREM', K_FRESH, P .. A .. t)
    call('ZREM', K_FKEY, kk .. P .. A .. t)
  else
    call('ZREM', K_GRP, P .. kk .. A .. t)
    if call('ZLEXCOUNT', K_GRP, '[' .. P .. kk, '(' .. P .. kk .. ':') == 0 then
      call('ZREM', K_GIDX, P .. pad(tonumber(s)) .. kk)
      call('ZREM', K_KPRIO, kk .. P)
    end
  end
end

local function remove_waiter(key_mode, lifo, t)
  local v = call('HGET', K_WAITERS, t)
  if not v then
    return
  end
  local p, a, k = parse_waiter(v)
  index_remove(key_mode, lifo, t, p, a, k)
  call('HDEL', K_WAITERS, t)
  call('ZREM', K_SEEN, t)
end

local function owner_dec(o)
  if call('HINCRBY', K_OWNERS, o, -1) <= 0 then
    call('HDEL', K_OWNERS, o)
  end
end

-- ---------------------------------------------------------------------------------------------
if op == 'release' then
  local key_mode, lifo = parse_mode(call('HGET', K_META, 'mode'))
  local owner = call('HGET', K_SLOTS, ticket)
  remove_waiter(key_mode, lifo, ticket)
  if owner then
    call('HDEL', K_SLOTS, ticket)
    owner_dec(owner)
    call('PUBLISH', channel, queue)
    return 1
  end
  return 0
end

if op == 'inflight' then
  return call('HLEN', K_SLOTS)
end

-- adopt: the process about to execute a step takes over its slot, so the slot lives as long as
-- the execution does (its heartbeat), not as long as the process that happened to admit it.
-- Returns 0 when the slot is gone (its owner died and it was reclaimed): the step must re-admit.
if op == 'adopt' then
  local owner = call('HGET', K_SLOTS, ticket)
  if not owner then
    return 0
  end
  if call('PEXPIRE', K_HEARTBEAT, tonumber(ARGV[7])) == 0 then
    call('SET', K_HEARTBEAT, me, 'PX', tonumber(ARGV[7]))
  end
  if owner ~= me then
    call('HSET', K_SLOTS, ticket, me)
    owner_dec(owner)
    call('HINCRBY', K_OWNERS, me, 1)
  end
  return 1
end

-- ---------------------------------------------------------------------------------------------
-- admit. Returns {1, now} (admitted) or {0, now, retry_at, reason}.
local now = now_ms()
local raw = call('HGET', K_QUEUES, queue)
if not raw then
  return {1, now} -- never registered: not gated
end
local cfg = cjson.decode(raw)
local priority, key = tonumber(ARGV[4]), ARGV[5]
local instance_ttl, waiter_ttl = tonumber(ARGV[7]), tonumber(ARGV[8])

-- A process that is deciding is alive: refresh its heartbeat here too, so a slot taken now can
-- never be reclaimed at once because the heartbeat thread was late (GC pause, busy host).
if call('PEXPIRE', K_HEARTBEAT, instance_ttl) == 0 then
  call('SET', K_HEARTBEAT, me, 'PX', instance_ttl)
end

-- 1. Already holds a slot: admitted, no second slot. A slot whose owner died is adopted by the
--    asker, so the re-asking process now keeps it alive.
local owner = call('HGET', K_SLOTS, ticket)
if owner then
  if owner ~= me and call('EXISTS', hb_prefix .. owner) == 0 then
    call('HSET', K_SLOTS, ticket, me)
    owner_dec(owner)
    call('HINCRBY', K_OWNERS, me, 1)
  end
  return {1, now}
end

-- 2. Reclaim the slots of instances whose heartbeat lapsed. O(owners) EXISTS per decision (owners
--    = live processes holding slots on this queue); O(slots) only when one is found dead.
local dead, any_dead = {}, false
for _, o in ipairs(call('HKEYS', K_OWNERS)) do
  if call('EXISTS', hb_prefix .. o) == 0 then
    dead[o], any_dead = true, true
  end
end
if any_dead then
  local slots, reclaimed = call('HGETALL', K_SLOTS), 0
  for i = 1, #slots, 2 do
    if dead[slots[i + 1]] then
      call('HDEL', K_SLOTS, slots[i])
      reclaimed = reclaimed + 1
    end
  end
  for o in pairs(dead) do
    call('HDEL', K_OWNERS, o)
  end
  if reclaimed > 0 then
    call('PUBLISH', channel, queue)
  end
end

-- 3. The index mode follows the config; a re-registration that changes fairness or order
--    rebuilds it (O(waiters), once per such change).
local key_mode, lifo = cfg.fairness == 'key', cfg.order == 'lifo'
local want_mode = cfg.fairness .. '/' .. cfg.order
local have_mode = call('HGET', K_META, 'mode')
if have_mode ~= want_mode then
  if have_mode then
    call('DEL', K_FRESH, K_GRP, K_GIDX, K_KPRIO, K_FKEY)
    local all = call('HGETALL', K_WAITERS)
    for i = 1, #all, 2 do
      local p, a, k = parse_waiter(all[i + 1])
      index_add(key_mode, lifo, all[i], p, a, k)
    end
  end
  call('HSET', K_META, 'mode', want_mode)
end

-- 4. Forget waiters that gave up (not seen for waiter_ttl) and marks outside every window.
--    Amortised O(log N) per expired waiter.
for _, t in ipairs(call('ZRANGEBYSCORE', K_SEEN, '-inf', '(' .. (now - waiter_ttl))) do
  remove_waiter(key_mode, lifo, t)
end
local rate = cfg.rate_limit
if type(rate) ~= 'table' then
  rate = nil
end
if rate then
  local oldest
  if rate.algorithm == 'fixed' then
    oldest = now - now % rate.period_ms
  else
    oldest = now - rate.period_ms + 1
  end
  call('ZREMRANGEBYSCORE', K_MARKS, '-inf', '(' .. oldest)
end

-- 5. Register the waiter, or refresh it keeping its original arrival.
local arrival
local v = call('HGET', K_WAITERS, ticket)
if v then
  local p0, a0, k0 = parse_waiter(v)
  arrival = a0
  if p0 ~= priority or k0 ~= key then
    index_remove(key_mode, lifo, ticket, p0, a0, k0)
    index_add(key_mode, lifo, ticket, priority, arrival, key)
    call('HSET', K_WAITERS, ticket, priority .. '|' .. arrival .. '|' .. key)
  end
else
  arrival = call('HINCRBY', K_META, 'arrival', 1)
  index_add(key_mode, lifo, ticket, priority, arrival, key)
  call('HSET', K_WAITERS, ticket, priority .. '|' .. arrival .. '|' .. key)
end
call('ZADD', K_SEEN, now, ticket)

-- 6. The rate limit first: it blocks every caller equally, whatever its rank.
local room = nil
if rate then
  local limit, period = rate.limit, rate.period_ms
  if rate.algorithm == 'fixed' then
    local start = now - now % period
    local used = call('ZCOUNT', K_MARKS, start, '+inf')
    if used >= limit then
      return {0, now, start + period, 'rate_limited'}
    end
    room = limit - used
  else
    local floor = '(' .. (now - period)
    local inside = call('ZCOUNT', K_MARKS, floor, '+inf')
    if inside >= limit then
      -- The (inside - limit)-th mark inside the window must age out before one more fits.
      local m = call('ZRANGEBYSCORE', K_MARKS, floor, '+inf', 'WITHSCORES', 'LIMIT', inside - limit, 1)
      return {0, now, tonumber(m[2]) + period, 'rate_limited'}
    end
    room = limit - inside
  end
end

-- 7. Concurrency.
local concurrency = cfg.concurrency
if type(concurrency) == 'number' then
  local free = concurrency - call('HLEN', K_SLOTS)
  if free <= 0 then
    return {0, now, now + cfg.retry_ms, 'concurrency'}
  end
  if room == nil or free < room then
    room = free
  end
end

-- 8. Rank: admitted iff fewer than `room` waiters outrank this one. Counting stops at `room`.
if room ~= nil then
  local P, A = penc(priority), aenc(arrival, lifo)
  local mine = P .. A .. ticket
  local count
  if not key_mode then
    count = call('ZLEXCOUNT', K_FRESH, '-', '(' .. mine)
  else
    -- Served-key waiters of a higher priority always come first.
    count = call('ZLEXCOUNT', K_GRP, '-', '(' .. P)
    local served = call('HGET', K_SERVED, key)
    if not served then
      -- Never served (-1): ahead of every served key at this priority; arrival among the rest.
      count = count + call('ZLEXCOUNT', K_FRESH, '-', '(' .. mine)
    else
      local kk = kenc(key)
      count = count + call('ZLEXCOUNT', K_FRESH, '-', '(' .. P .. ':')
      if count < room then
        -- Groups of keys served less recently than ours, at our priority: at most `room` of them
        -- are looked at (each holds at least one waiter).
        local groups = call('ZRANGEBYLEX', K_GIDX, '[' .. P, '(' .. P .. pad(tonumber(served)), 'LIMIT', 0, room)
        for _, g in ipairs(groups) do
          local gk = string.sub(g, 33)
          count = count + call('ZLEXCOUNT', K_GRP, '[' .. P .. gk, '(' .. P .. gk .. ':')
          if count >= room then
            break
          end
        end
        if count < room then
          count = count + call('ZLEXCOUNT', K_GRP, '[' .. P .. kk, '(' .. P .. kk .. A .. ticket)
        end
      end
    end
  end
  if count >= room then
    return {0, now, now + cfg.retry_ms, 'waiting_turn'}
  end
end

-- 9. Admit: take the slot, mark the window, and record the key as served.
remove_waiter(key_mode, lifo, ticket)
call('HSET', K_SLOTS, ticket, me)
call('HINCRBY', K_OWNERS, me, 1)
local serve = call('HINCRBY', K_META, 'serve', 1)
if rate then
  call('ZADD', K_MARKS, now, serve)
end
local previous = call('HGET', K_SERVED, key)
call('HSET', K_SERVED, key, serve)
if key_mode then
  local kk = kenc(key)
  local n = #kk
  if not previous then
    -- First serve of this key: its waiters leave the never-served tie and form groups.
    -- O(waiters of this key), once per key.
    local seen_p = {}
    for _, m in ipairs(call('ZRANGEBYLEX', K_FKEY, '[' .. kk, '(' .. kk .. ':')) do
      local P, A, t = string.sub(m, n + 1, n + 16), string.sub(m, n + 17, n + 32), string.sub(m, n + 33)
      call('ZREM', K_FRESH, P .. A .. t)
      call('ZADD', K_GRP, 0, P .. kk .. A .. t)
      if not seen_p[P] then
        seen_p[P] = true
        call('ZADD', K_GIDX, 0, P .. pad(serve) .. kk)
        call('ZADD', K_KPRIO, 0, kk .. P)
      end
    end
    call('ZREMRANGEBYLEX', K_FKEY, '[' .. kk, '(' .. kk .. ':')
  else
    -- Re-serve: the key's groups move to the back of their priority tier. O(its priorities).
    for _, m in ipairs(call('ZRANGEBYLEX', K_KPRIO, '[' .. kk, '(' .. kk .. ':')) do
      local P = string.sub(m, n + 1)
      call('ZREM', K_GIDX, P .. pad(tonumber(previous)) .. kk)
      call('ZADD', K_GIDX, 0, P .. pad(serve) .. kk)
    end
  end
end
return {1, now}
