-- durable_flow fleet-wide admission: every read and write of one queue's accounting, atomically.
--
-- Loaded once by `durable_flow/admission/redis/backend.py` (redis-py `register_script`, i.e. EVALSHA) and
-- dispatched on ARGV[1]: "admit" (`policy.decide`: join the line, grant the room), "release"
-- (free a slot and grant it on), "grant", "reoffer" (the safety net), "start" (count a step start
-- in the rate window), "adopt", "inflight".
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
-- All are score-0 sorted sets read with ZLEXCOUNT / ZRANGEBYLEX, so every rank query, and finding
-- the rightful next waiter, is O(log N).
-- Lua numbers are doubles: integers are exact below 2^53, which every encoded value stays under.

local K_QUEUES, K_SLOTS, K_OWNERS, K_WAITERS, K_STARTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_FRESH, K_GRP, K_GIDX, K_KPRIO, K_FKEY = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_SERVED, K_META, K_MARKS, K_HEARTBEAT = KEYS[11], KEYS[12], KEYS[13], KEYS[14]
local K_FLEET = KEYS[15] -- P:fleet, see hearing.lua

local op, queue, ticket = ARGV[1], ARGV[2], ARGV[3]
local me, hb_prefix, channel = ARGV[6], ARGV[10], ARGV[11]
-- The paused queues (a JSON list in ARGV[8], '' for none), whose waiters a freed resource passes over.
local PAUSED = {}
if ARGV[8] ~= '' then
  for _, name in ipairs(cjson.decode(ARGV[8])) do
    PAUSED[name] = true
  end
end

local call = redis.call

-- Step concurrency: resources.lua (in front of this file) keeps resource holders and lines. Calls
-- gated by their constraints alone use the pseudo-queue '' (no cap, no window; its waiters wait in
-- resource lines only). A freed resource may go to a waiter of another queue: `use_keys` points
-- the queue keys at it for that grant.
local PREFIX = string.sub(K_QUEUES, 1, -8)
local R = new_resources(PREFIX, call)
local FREE_CFG = { fairness = 'fifo', order = 'fifo', retry_ms = 1000 }

local function use_keys(q)
  local b = PREFIX .. ':q:' .. q .. ':'
  K_SLOTS, K_OWNERS, K_WAITERS, K_STARTS = b .. 'slots', b .. 'owners', b .. 'waiters', b .. 'starts'
  K_FRESH, K_GRP, K_GIDX, K_KPRIO, K_FKEY = b .. 'fresh', b .. 'grp', b .. 'gidx', b .. 'kprio', b .. 'fkey'
  K_SERVED, K_META, K_MARKS = b .. 'served', b .. 'meta', b .. 'marks'
  queue = q
end

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
end

local function owner_dec(o)
  if call('HINCRBY', K_OWNERS, o, -1) <= 0 then
    call('HDEL', K_OWNERS, o)
  end
end

local function refresh_heartbeat()
  local ttl = tonumber(ARGV[7])
  if call('PEXPIRE', K_HEARTBEAT, ttl) == 0 then
    call('SET', K_HEARTBEAT, me, 'PX', ttl)
  end
end

-- How long the server has heard the fleet without a silence (hearing.lua): every call counts.
local heard_for = fleet_heard_for(call, K_FLEET, tonumber(ARGV[7]))

if op == 'inflight' then
  return call('HLEN', K_SLOTS)
end

-- adopt: the process about to execute a step takes over its slot, so the slot lives as long as
-- the execution does (its heartbeat), not as long as the process that happened to admit it.
-- Returns 0 when the slot is gone (its owner died and it was reclaimed): the step must re-admit.
if op == 'adopt' then
  local owner = call('HGET', K_SLOTS, ticket)
  if not owner and queue ~= '' then
    use_keys('') -- a slot of a call gated by its constraints alone
    owner = call('HGET', K_SLOTS, ticket)
  end
  if not owner then
    return 0
  end
  refresh_heartbeat()
  if owner ~= me then
    call('HSET', K_SLOTS, ticket, me)
    owner_dec(owner)
    call('HINCRBY', K_OWNERS, me, 1)
  end
  return 1
end

-- ---------------------------------------------------------------------------------------------
-- Every other op reads the queue's config and the clock.
local now = now_ms()
local raw = call('HGET', K_QUEUES, queue)
local cfg = raw and cjson.decode(raw) or nil
local cs = op == 'admit' and R.parse(ARGV, 12) or {}
if queue ~= '' and ((op == 'admit' and not cfg and #cs > 0) or (op == 'release'
    and call('HEXISTS', K_SLOTS, ticket) == 0 and call('HEXISTS', K_WAITERS, ticket) == 0
    and call('HEXISTS', PREFIX .. ':q::slots', ticket) + call('HEXISTS', PREFIX .. ':q::waiters', ticket) > 0)) then
  use_keys('')
end
local pseudo = queue == ''
if pseudo then
  cfg = FREE_CFG
end
local rate = cfg and cfg.rate_limit or nil
if type(rate) ~= 'table' then
  rate = nil
end

local function window_start(period)
  if rate.algorithm == 'fixed' then
    return now - now % period
  end
  return now - period + 1
end

-- A window's state over a zset of marks: {room, reopen_at}; reopen_at is set when room is 0.
-- `period` defaults to the rate limit's (the start window passes a widened one).
local function window(k_marks, period)
  local limit = rate.limit
  period = period or rate.period_ms
  call('ZREMRANGEBYSCORE', k_marks, '-inf', '(' .. window_start(period))
  local used = call('ZCOUNT', k_marks, '-inf', '+inf')
  if used < limit then
    return limit - used, nil
  end
  if rate.algorithm == 'fixed' then
    return 0, now - now % period + period
  end
  -- The (used - limit)-th mark inside must age out before one more fits.
  local m = call('ZRANGEBYSCORE', k_marks, '-inf', '+inf', 'WITHSCORES', 'LIMIT', used - limit, 1)
  return 0, tonumber(m[2]) + period
end

-- ---------------------------------------------------------------------------------------------
-- Per-key rate windows and the GCRA throttle (`admission/keyed.py` is the rulebook). Their state
-- lives in keys named per fairness key (under the queue's root: on Redis Cluster its shard's hash tag):
--   R kw:<key>      zset   the key's grants in its window (member "ms:seq", score ms)
--   R ks:<key>      zset   the key's step starts in its (widened) start window
--   R kt:g:<bucket> string a throttle bucket's TAT over grants ("%.17g": exact doubles)
--   R kt:s:<bucket> string the same over step starts
-- where R is this queue's key root ("P:q:Q:") and a bucket is the key, or '' for a queue-wide
-- throttle. Every one carries a PX TTL, so an idle key's state expires by itself: a window's
-- once its last mark is out, a TAT's once it is past (both are then as good as absent). A test
-- clock (ARGV[9]) runs apart from Redis' own, so its TTLs get ten minutes of slack.
local KROOT = string.sub(K_SLOTS, 1, #K_SLOTS - 5)
local krate = cfg and type(cfg.key_rate_limit) == 'table' and cfg.key_rate_limit or nil
local thr = cfg and type(cfg.throttle) == 'table' and cfg.throttle or nil
local keyed_on = krate ~= nil or thr ~= nil
local TTL_SLACK = (ARGV[9] ~= '') and 600000 or 1000

-- When a key's window over zset `z` (`rate` r, `period` ms) reopens, or nil if it has room.
local function kwin_until(z, r, period)
  local start = now - period + 1
  if r.algorithm == 'fixed' then
    start = now - now % period
  end
  call('ZREMRANGEBYSCORE', z, '-inf', '(' .. start)
  local used = call('ZCARD', z)
  if used < r.limit then
    return nil
  end
  if r.algorithm == 'fixed' then
    return start + period
  end
  local m = call('ZRANGE', z, used - r.limit, used - r.limit, 'WITHSCORES')
  return tonumber(m[2]) + period
end

local function kwin_add(z, period)
  call('ZADD', z, now, now .. ':' .. call('HINCRBY', K_META, 'kseq', 1))
  call('PEXPIRE', z, period + TTL_SLACK)
end

local function tbucket(k)
  if thr.per == 'key' then
    return k
  end
  return ''
end

-- GCRA: nil when a call conforms now (`lead` ms early), else the first whole ms it will.
local function gcra_until(tk, lead)
  local tat = tonumber(call('GET', tk))
  if not tat then
    return nil
  end
  local tau = (thr.burst - 1) * (thr.period_ms / thr.limit)
  lead = lead or 0
  if tat - tau - lead <= now then
    return nil
  end
  return math.ceil(tat - tau - lead)
end

-- `keyed.start_lead_ms`: how far grants may run ahead of the throttle's start side.
local function start_lead()
  return math.min(1000, 4 * (thr.period_ms / thr.limit))
end

local function gcra_take(tk)
  local tat = tonumber(call('GET', tk)) or now
  tat = math.max(tat, now) + thr.period_ms / thr.limit
  call('SET', tk, string.format('%.17g', tat), 'PX', math.ceil(tat - now) + TTL_SLACK)
end

local function later(a, b)
  if not a then
    return b
  end
  if not b or a > b then
    return a
  end
  return b
end

-- The per-key start window: sliding ones widened like `policy.start_margin_ms`.
local function kstart_period()
  if krate.algorithm == 'fixed' then
    return krate.period_ms
  end
  return krate.period_ms + math.min(50, math.floor(krate.period_ms / 20))
end

-- `keyed.throttle_blocks_all`: a queue-wide throttle's next conforming instant (its grant and its
-- start TAT), or nil.
local function throttle_blocks_all()
  if not thr or thr.per == 'key' then
    return nil
  end
  return later(gcra_until(KROOT .. 'kt:g:'), gcra_until(KROOT .. 'kt:s:', start_lead()))
end

-- `keyed.key_blocked_until`: when a waiter of key `k` may be granted (its window and throttle,
-- each over grants and over starts), or nil if it may now.
local function key_blocked_until(k)
  local untl = nil
  if krate then
    untl = kwin_until(KROOT .. 'kw:' .. k, krate, krate.period_ms)
    untl = later(untl, kwin_until(KROOT .. 'ks:' .. k, krate, kstart_period()))
  end
  if thr and thr.per == 'key' then
    untl = later(untl, gcra_until(KROOT .. 'kt:g:' .. k))
    untl = later(untl, gcra_until(KROOT .. 'kt:s:' .. k, start_lead()))
  end
  return untl
end

-- `keyed.take`: count a grant of key `k`.
local function keyed_take(k)
  if krate then
    kwin_add(KROOT .. 'kw:' .. k, krate.period_ms)
  end
  if thr then
    gcra_take(KROOT .. 'kt:g:' .. tbucket(k))
  end
end

-- `keyed.start_wait`: the latest instant the key's start window or throttle bucket reopens (0: now).
local function keyed_start_wait(k)
  local latest = 0
  if krate then
    latest = kwin_until(KROOT .. 'ks:' .. k, krate, kstart_period()) or 0
  end
  if thr then
    latest = math.max(latest, gcra_until(KROOT .. 'kt:s:' .. tbucket(k)) or 0)
  end
  return latest
end

-- `keyed.count_start`: count a step start of key `k`.
local function keyed_count_start(k)
  if krate then
    kwin_add(KROOT .. 'ks:' .. k, kstart_period())
  end
  if thr then
    gcra_take(KROOT .. 'kt:s:' .. tbucket(k))
  end
end
-- ---------------------------------------------------------------------------------------------

local function free_slots()
  if type(cfg.concurrency) == 'number' then
    return math.max(0, cfg.concurrency - call('HLEN', K_SLOTS))
  end
  return nil
end

-- start: a granted step is about to run. Count it in the rate window of step starts, or say how
-- many ms to wait until the window has room (0: started).
if op == 'start' then
  if not rate and not keyed_on then
    return {0, now}
  end
  local wait_until = 0
  -- `policy.start_mark`: where a start is counted (a sliding window may count it up to
  -- `policy.start_backdate_ms` back, from the instant its room opened).
  local mark = now
  if rate and rate.algorithm == 'fixed' then
    local room, reopen = window(K_STARTS)
    if room == 0 then
      wait_until = reopen
    end
  elseif rate then
    -- A sliding start window is widened by `policy.start_margin_ms` (see there), and keeps
    -- `policy.start_backdate_ms` more of its marks (`policy.oldest_start_needed`).
    local margin = math.min(50, math.floor(rate.period_ms / 20))
    local period, back = rate.period_ms + margin, math.floor(margin / 2)
    call('ZREMRANGEBYSCORE', K_STARTS, '-inf', '(' .. (now - period + 1 - back))
    local used = call('ZCOUNT', K_STARTS, '(' .. (now - period), '+inf')
    if used >= rate.limit then
      local m = call('ZRANGEBYSCORE', K_STARTS, '(' .. (now - period), '+inf', 'WITHSCORES', 'LIMIT', used - rate.limit, 1)
      wait_until = tonumber(m[2]) + period
    else
      mark = now - back
      local nth = call('ZREVRANGE', K_STARTS, rate.limit - 1, rate.limit - 1, 'WITHSCORES')
      if nth[2] then
        mark = math.max(mark, tonumber(nth[2]) + period)
      end
      mark = math.min(mark, now)
    end
  end
  if keyed_on then
    wait_until = math.max(wait_until, keyed_start_wait(ARGV[5]))
  end
  if wait_until > 0 then
    return {math.max(1, wait_until - now), now}
  end
  if rate then
    call('ZADD', K_STARTS, mark, mark .. ':' .. call('HINCRBY', K_META, 'starts', 1))
  end
  if keyed_on then
    keyed_count_start(ARGV[5])
  end
  return {0, now}
end

-- release: free the slot (whoever owns it) and withdraw the waiter; then grant the room on,
-- below, unless ARGV[12] is '0' (a paused queue).
local freed = 0
local rfreed = {} -- resources freed by this call (a release, reclaimed slots), granted on below
if op == 'release' then
  local key_mode, lifo = parse_mode(call('HGET', K_META, 'mode'))
  remove_waiter(key_mode, lifo, ticket)
  local owner = call('HGET', K_SLOTS, ticket)
  if owner then
    call('HDEL', K_SLOTS, ticket)
    owner_dec(owner)
    freed = 1
  end
  R.unwait(ticket)
  R.free(ticket, rfreed)
  if (not cfg or ARGV[12] == '0') and #rfreed == 0 then
    return {freed, ''}
  end
end

if not cfg then
  if op == 'admit' then
    return {1, now, '', '', '', ''} -- never registered: not gated
  end
  return {''}
end

-- A process that is deciding is alive: refresh its heartbeat here too, so a slot taken now can
-- never be reclaimed at once because the heartbeat thread was late (GC pause, busy host).
refresh_heartbeat()

-- 1. Already holds a slot: admitted, no second slot. A slot whose owner died is adopted by the
--    asker, so the re-asking process now keeps it alive.
if op == 'admit' then
  local owner = call('HGET', K_SLOTS, ticket)
  if owner then
    if owner ~= me and call('EXISTS', hb_prefix .. owner) == 0 then
      call('HSET', K_SLOTS, ticket, me)
      owner_dec(owner)
      call('HINCRBY', K_OWNERS, me, 1)
    end
    return {1, now, '', '', '', ''}
  end
end

-- 2. Reclaim the slots of instances whose heartbeat lapsed. O(owners) EXISTS per decision (owners
--    = live processes holding slots on this queue); O(slots) only when one is found dead. Not
--    until the server has heard the fleet for a TTL (hearing.lua): after an outage every
--    heartbeat may have lapsed, the live processes' too.
local dead, any_dead = {}, false
if heard_for >= tonumber(ARGV[7]) then
  for _, o in ipairs(call('HKEYS', K_OWNERS)) do
    if call('EXISTS', hb_prefix .. o) == 0 then
      dead[o], any_dead = true, true
    end
  end
end
if any_dead then
  local slots = call('HGETALL', K_SLOTS)
  for i = 1, #slots, 2 do
    if dead[slots[i + 1]] then
      call('HDEL', K_SLOTS, slots[i])
      R.free(slots[i], rfreed)
    end
  end
  for o in pairs(dead) do
    call('HDEL', K_OWNERS, o)
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

-- Register a waiter, or refresh it keeping its original arrival (its place in line).
local function add_waiter(t, priority, key)
  local v = call('HGET', K_WAITERS, t)
  if v then
    local p0, a0, k0 = parse_waiter(v)
    if p0 ~= priority or k0 ~= key then
      index_remove(key_mode, lifo, t, p0, a0, k0)
      index_add(key_mode, lifo, t, priority, a0, key)
      call('HSET', K_WAITERS, t, priority .. '|' .. a0 .. '|' .. key)
    end
    return
  end
  local arrival = call('HINCRBY', K_META, 'arrival', 1)
  index_add(key_mode, lifo, t, priority, arrival, key)
  call('HSET', K_WAITERS, t, priority .. '|' .. arrival .. '|' .. key)
end

-- The rightful next waiter (`policy.rank`'s smallest), or nil. O(log N).
local function best_waiter()
  local f = call('ZRANGEBYLEX', K_FRESH, '-', '+', 'LIMIT', 0, 1)[1]
  if not key_mode then
    return f and string.sub(f, 33) or nil
  end
  local g = call('ZRANGEBYLEX', K_GIDX, '-', '+', 'LIMIT', 0, 1)[1]
  -- At equal priority a never-served key (fresh) comes before every served one.
  if f and (not g or string.sub(f, 1, 16) <= string.sub(g, 1, 16)) then
    return string.sub(f, 33)
  end
  if not g then
    return nil
  end
  local P, kk = string.sub(g, 1, 16), string.sub(g, 33)
  local m = call('ZRANGEBYLEX', K_GRP, '[' .. P .. kk, '(' .. P .. kk .. ':', 'LIMIT', 0, 1)[1]
  return string.sub(m, 16 + #kk + 17)
end

-- Per-key limits: the rightful next waiter whose key's own limits have room (`policy._best_fitting`):
-- a blocked key's waiters are skipped, never in the way. `cache` memoizes key -> until (false:
-- free). Costs one step per skipped entry: per blocked waiter ahead in fairness "fifo", per blocked
-- key's group in fairness "key" (plus its never-served waiters, which no limit can block yet).
local function waiter_key(t)
  local _, _, k = parse_waiter(call('HGET', K_WAITERS, t))
  return k
end

local function kblocked(cache, k)
  local v = cache[k]
  if v == nil then
    v = key_blocked_until(k) or false
    cache[k] = v
  end
  return v ~= false
end

local function best_allowed_waiter(cache)
  local fi, gi = 0, 0
  while true do
    local f = call('ZRANGEBYLEX', K_FRESH, '-', '+', 'LIMIT', fi, 1)[1]
    local g = nil
    if key_mode then
      g = call('ZRANGEBYLEX', K_GIDX, '-', '+', 'LIMIT', gi, 1)[1]
    end
    if not f and not g then
      return nil
    end
    if f and (not g or string.sub(f, 1, 16) <= string.sub(g, 1, 16)) then
      local t = string.sub(f, 33)
      if not kblocked(cache, waiter_key(t)) then
        return t
      end
      fi = fi + 1
    else
      local P, kk = string.sub(g, 1, 16), string.sub(g, 33)
      if not kblocked(cache, string.sub(kk, 7)) then
        local m = call('ZRANGEBYLEX', K_GRP, '[' .. P .. kk, '(' .. P .. kk .. ':', 'LIMIT', 0, 1)[1]
        return string.sub(m, 16 + #kk + 17)
      end
      gi = gi + 1
    end
  end
end

-- `keyed.reopens_at` over the keys a grant found blocked (it scanned every waiter when it found
-- none to grant, so `cache` holds every waiting key).
local function keyed_reopen(cache)
  local at = throttle_blocks_all()
  if at then
    return at
  end
  for _, v in pairs(cache) do
    if v and (not at or v < at) then
      at = v
    end
  end
  return at
end

-- The waiter takes a slot: mark the grant window, record its key as served and re-rank the key.
local function take_slot(t)
  local p, a, key = parse_waiter(call('HGET', K_WAITERS, t))
  remove_waiter(key_mode, lifo, t)
  call('HSET', K_SLOTS, t, me)
  call('HINCRBY', K_OWNERS, me, 1)
  local serve = call('HINCRBY', K_META, 'serve', 1)
  if rate then
    call('ZADD', K_MARKS, now, serve)
  end
  if keyed_on then
    keyed_take(key)
  end
  local previous = call('HGET', K_SERVED, key)
  call('HSET', K_SERVED, key, serve)
  if not key_mode then
    return
  end
  local kk = kenc(key)
  local n = #kk
  if not previous then
    -- First serve of this key: its waiters leave the never-served tie and form groups.
    -- O(waiters of this key), once per key.
    local seen_p = {}
    for _, m in ipairs(call('ZRANGEBYLEX', K_FKEY, '[' .. kk, '(' .. kk .. ':')) do
      local P, A, w = string.sub(m, n + 1, n + 16), string.sub(m, n + 17, n + 32), string.sub(m, n + 33)
      call('ZREM', K_FRESH, P .. A .. w)
      call('ZADD', K_GRP, 0, P .. kk .. A .. w)
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

-- `policy.grant`: every slot there is room for goes to the rightful next waiters, one at a time
-- (each grant re-ranks its key). Returns the granted tickets and, when waiters are left that only
-- the rate window holds back, the instant it reopens ('' otherwise).
local function grant(out)
  local room, free = nil, free_slots()
  if rate then
    room = window(K_MARKS)
  end
  if free ~= nil and (room == nil or free < room) then
    room = free
  end
  local aside, kcache = {}, {}
  while room == nil or room > 0 do
    if keyed_on and throttle_blocks_all() then
      break
    end
    local t
    if keyed_on then
      t = best_allowed_waiter(kcache)
    else
      t = best_waiter()
    end
    if not t then
      break
    end
    local tcs = R.constraints(t)
    if R.fits(tcs) then
      if keyed_on then
        kcache[waiter_key(t)] = nil
      end
      take_slot(t)
      R.take(t, tcs)
      out[#out + 1] = t
      if room then
        room = room - 1
      end
    elseif #aside >= R.MAX_SCAN then
      break
    else
      -- Blocked by its step concurrency: set aside for this call, so it holds up nobody behind it.
      local p, a, k = parse_waiter(call('HGET', K_WAITERS, t))
      index_remove(key_mode, lifo, t, p, a, k)
      aside[#aside + 1] = { t, p, a, k }
    end
  end
  for _, w in ipairs(aside) do
    index_add(key_mode, lifo, w[1], w[2], w[3], w[4])
  end
  local reopen = ''
  if (rate or keyed_on) and call('HLEN', K_WAITERS) > 0 then
    free = free_slots()
    if free == nil or free > 0 then
      if rate then
        local r, at = window(K_MARKS)
        if r == 0 then
          reopen = at
        end
      end
      if reopen == '' and keyed_on then
        reopen = keyed_reopen(kcache) or ''
      end
    end
  end
  return reopen
end

-- The pseudo-queue's take: no cap, no window, no ranking.
local function take_free(t, tcs)
  call('HDEL', K_WAITERS, t)
  call('HSET', K_SLOTS, t, me)
  call('HINCRBY', K_OWNERS, me, 1)
  R.take(t, tcs)
end

-- resources.lua's gate: give waiter t its slot on queue q (any queue) if q has room now.
local function gate(q, t)
  local saved = { queue, cfg, rate, key_mode, lifo }
  if q ~= queue then
    local raw_q = q ~= '' and call('HGET', K_QUEUES, q) or nil
    local cfg_q = (q == '' and FREE_CFG) or (raw_q and cjson.decode(raw_q)) or nil
    if not cfg_q then
      return false
    end
    if type(cfg_q.key_rate_limit) == 'table' or type(cfg_q.throttle) == 'table' then
      -- Per-key limits are read for this call's queue only: that queue's own next grant (or the
      -- poller's grant tick) hands the freed resource on, with its key's limits checked.
      return false
    end
    use_keys(q)
    cfg, rate = cfg_q, type(cfg_q.rate_limit) == 'table' and cfg_q.rate_limit or nil
    key_mode, lifo = cfg.fairness == 'key', cfg.order == 'lifo'
  end
  local ok = call('HEXISTS', K_WAITERS, t) == 1
  if ok and q == '' then
    take_free(t, {}) -- its resources are taken by the caller, grant_freed
  elseif ok then
    -- Its queue's index must be built for the config's mode (the next decision there rebuilds it).
    local free, room = free_slots(), nil
    if rate then
      room = window(K_MARKS)
    end
    ok = call('HGET', K_META, 'mode') == cfg.fairness .. '/' .. cfg.order
      and (free == nil or free > 0) and (room == nil or room > 0)
      and not (q == saved[1] and keyed_on and (throttle_blocks_all() or key_blocked_until(waiter_key(t))))
    if ok then
      take_slot(t)
    end
  end
  if saved[1] ~= queue then
    use_keys(saved[1])
    cfg, rate, key_mode, lifo = saved[2], saved[3], saved[4], saved[5]
  end
  return ok
end

if op == 'release' then
  local out = {freed, ''}
  if not pseudo and ARGV[12] ~= '0' then
    out[2] = grant(out)
  end
  if ARGV[12] == '0' then
    PAUSED[queue] = true
  end
  R.grant_freed(rfreed, gate, out, PAUSED)
  return out
end

if op == 'grant' then
  local out = {''}
  if pseudo then
    rfreed = R.waited_for() -- the safety net: every resource somebody waits for
  else
    out[1] = grant(out)
  end
  R.grant_freed(rfreed, gate, out, PAUSED)
  return out
end

-- reoffer: ARGV[12..] are (ticket, priority, key) triples of parked calls. Returns the tickets
-- that hold a slot already; registers the others as waiters unless they are (keeping their place).
if op == 'reoffer' then
  local held = {}
  for i = 12, #ARGV, 4 do
    local t, p = ARGV[i], tonumber(ARGV[i + 1])
    if call('HEXISTS', K_SLOTS, t) == 1 then
      held[#held + 1] = t
    elseif call('HEXISTS', K_WAITERS, t) == 0 then
      if pseudo then
        call('HSET', K_WAITERS, t, p .. '|0|' .. ARGV[i + 2])
      else
        add_waiter(t, p, ARGV[i + 2])
      end
      R.wait(t, queue, p, cjson.decode(ARGV[i + 3]))
    end
  end
  return held
end

-- admit. Returns {admitted, now, retry_at, reason, held_by, limits, granted...}: the caller joins
-- the line and the room is granted; it is admitted if it was among the granted, and the others
-- granted are returned for the engine to dispatch. A blocked call is told which limit held it
-- (`held_by`: 'queue' or 'key' for a rate window, the full constraint's index in its constraints
-- for step concurrency) and the queue's config it was decided by (`limits`, its registered JSON;
-- '' for the pseudo-queue), so the engine records why it waits with no second round trip.
local out = {0, now, '', ''}
R.grant_freed(rfreed, gate, out, PAUSED) -- reclaimed resources go to those already waiting
if pseudo then
  if call('HEXISTS', K_SLOTS, ticket) == 0 then
    if R.fits(cs) then
      take_free(ticket, cs)
      out[#out + 1] = ticket
    else
      if call('HEXISTS', K_WAITERS, ticket) == 0 then
        call('HSET', K_WAITERS, ticket, ARGV[4] .. '|0|' .. ARGV[5])
      end
      R.wait(ticket, '', tonumber(ARGV[4]), cs)
    end
  else
    out[#out + 1] = ticket
  end
elseif call('HEXISTS', K_SLOTS, ticket) == 1 then
  out[#out + 1] = ticket -- granted just now, a reclaimed resource's waiter
else
  add_waiter(ticket, tonumber(ARGV[4]), ARGV[5])
  R.wait(ticket, queue, tonumber(ARGV[4]), cs)
  grant(out)
end
local others = {}
for i = 5, #out do
  if out[i] == ticket then
    out[1] = 1
  else
    others[#others + 1] = out[i]
  end
end
local reply = {out[1], now, '', '', '', ''}
local full = out[1] == 0 and R.first_full(cs) or nil
if full then
  reply[3], reply[4], reply[5] = now + cfg.retry_ms, 'step_concurrency', full
elseif out[1] == 0 then
  local room, reopen = nil, nil
  if rate then
    room, reopen = window(K_MARKS)
  end
  local kat = nil
  if room ~= 0 and keyed_on then
    kat = throttle_blocks_all() or key_blocked_until(ARGV[5])
  end
  if room == 0 then
    reply[3], reply[4], reply[5] = reopen, 'rate_limited', 'queue'
  elseif kat then
    reply[3], reply[4], reply[5] = kat, 'rate_limited', 'key'
  else
    local free = free_slots()
    reply[3] = now + cfg.retry_ms
    reply[4] = (free ~= nil and free == 0) and 'concurrency' or 'waiting_turn'
  end
end
if out[1] == 0 and raw and not pseudo then
  reply[6] = raw
end
for _, t in ipairs(others) do
  reply[#reply + 1] = t
end
return reply
