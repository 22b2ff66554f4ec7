-- Step-concurrency resources for the Redis admission backend: the rules of `resources.py`, in Lua.
--
-- This file is not a script of its own: `redis_resources.script_source()` puts it in front of
-- admission.lua, so one EVALSHA decides a call's queue slot and its resource slots together
-- (all or none), and a release hands freed resources to their waiters in the same call.
--
-- Key layout (P = KEY_PREFIX, r = a resource name such as `sc:fn:<workflow>:<key>`):
--
--   P:res:<r>:held  set    tickets holding a slot of r (SCARD = r's active count)
--   P:res:<r>:line  zset   r's waiting line, score 0, member P(priority) .. A(arrival) .. ticket
--                          (lexicographic order = priority first, then arrival: FIFO per key)
--   P:res:hold      hash   ticket -> JSON [[r, limit], ...] it holds
--   P:res:need      hash   ticket -> JSON {q = queue, p = priority, a = arrival, c = [[r, limit], ...]}
--   P:res:ceil      hash   r -> the highest limit among its waiters (a grant stops scanning r's
--                          line once r is full for all of them)
--   P:res:active    zset   r -> active count, only while > 0 (the busiest keys, for the dashboard)
--   P:res:waiting   zset   r -> waiting count, only while > 0
--   P:res:served    hash   r -> serve number of its last grant (least-recently-served key first)
--   P:res:solo      hash   r -> serve number of the last grant of r to a call with no other resource
--   P:res:meta      hash   counters `arrival` and `serve`
--
-- Fairness across keys: a freed resource's line is read in (priority, arrival) order, in pages of
-- SCAN entries while it has room (at most MAX_SCAN); within a page, among the waiters that fit,
-- those whose *other* resource (e.g. their account's key,
-- under a shared ceiling) was served least recently go first, so one key's backlog on a shared
-- resource cannot starve the other keys. Calls that need the shared resource alone form one more
-- key of their own (`solo`), served in turn with the others. Within one key the order stays
-- arrival (FIFO).
--
-- Resource keys are named inside the script (as the heartbeat keys are), so this needs a single,
-- non-cluster Redis, like the rest of the backend.

local function new_resources(prefix, call)
  local R = { SCAN = 200, MAX_SCAN = 5000 } -- resources.py's SCAN and MAX_SCAN
  local K_HOLD, K_NEED, K_CEIL = prefix .. ':res:hold', prefix .. ':res:need', prefix .. ':res:ceil'
  local K_ACTIVE, K_WAITING = prefix .. ':res:active', prefix .. ':res:waiting'
  local K_SERVED, K_SOLO, K_META = prefix .. ':res:served', prefix .. ':res:solo', prefix .. ':res:meta'

  local function held_key(r) return prefix .. ':res:' .. r .. ':held' end
  local function line_key(r) return prefix .. ':res:' .. r .. ':line' end
  local function pad(n) return string.format('%016d', n) end
  local function member(p, a, t) return pad(5e15 - p) .. pad(a) .. t end

  local function bump(zset, r, by)
    if tonumber(call('ZINCRBY', zset, by, r)) <= 0 then
      call('ZREM', zset, r)
    end
  end

  -- Constraints as the caller passes them: n, r1, limit1, ..., rn, limitn from ARGV[i].
  function R.parse(argv, i)
    local cs, n = {}, tonumber(argv[i] or '') or 0
    for j = 1, n do
      cs[j] = { argv[i + 2 * j - 1], tonumber(argv[i + 2 * j]) }
    end
    return cs
  end

  function R.active(r) return call('SCARD', held_key(r)) end

  -- Whether every constraint has room for one more, each against its own limit.
  function R.fits(cs)
    for _, c in ipairs(cs) do
      if call('SCARD', held_key(c[1])) >= c[2] then
        return false
      end
    end
    return true
  end

  -- What a waiting ticket needs ({q, p, a, c}), or nil when it waits for no resource.
  function R.need(t)
    local v = call('HGET', K_NEED, t)
    return v and cjson.decode(v) or nil
  end

  -- The constraints a waiting ticket carries ({} when none).
  function R.constraints(t)
    local n = R.need(t)
    return n and n.c or {}
  end

  -- Forget a waiter (granted or withdrawn).
  function R.unwait(t)
    local n = R.need(t)
    if not n then
      return
    end
    for _, c in ipairs(n.c) do
      if call('ZREM', line_key(c[1]), member(n.p, n.a, t)) == 1 then
        bump(K_WAITING, c[1], -1)
        if call('EXISTS', line_key(c[1])) == 0 then
          call('HDEL', K_CEIL, c[1])
        end
      end
    end
    call('HDEL', K_NEED, t)
  end

  -- Put a waiter in the line of each resource it needs; a ticket already waiting keeps its arrival.
  function R.wait(t, q, p, cs)
    if #cs == 0 then
      return
    end
    local old = R.need(t)
    local a = old and old.a or call('HINCRBY', K_META, 'arrival', 1)
    R.unwait(t)
    for _, c in ipairs(cs) do
      call('ZADD', line_key(c[1]), 0, member(p, a, t))
      bump(K_WAITING, c[1], 1)
      local ceil = tonumber(call('HGET', K_CEIL, c[1]) or '0')
      if c[2] > ceil then
        call('HSET', K_CEIL, c[1], c[2])
      end
    end
    call('HSET', K_NEED, t, cjson.encode({ q = q, p = p, a = a, c = cs }))
  end

  -- The ticket holds a slot of each of its resources (and waits for none).
  function R.take(t, cs)
    R.unwait(t)
    if #cs == 0 then
      return
    end
    local serve = call('HINCRBY', K_META, 'serve', 1)
    for _, c in ipairs(cs) do
      if call('SADD', held_key(c[1]), t) == 1 then
        bump(K_ACTIVE, c[1], 1)
      end
      call('HSET', K_SERVED, c[1], serve)
    end
    if #cs == 1 then
      call('HSET', K_SOLO, cs[1][1], serve)
    end
    call('HSET', K_HOLD, t, cjson.encode(cs))
  end

  -- Give back the ticket's resource slots; appends the resources freed to `freed`.
  function R.free(t, freed)
    local v = call('HGET', K_HOLD, t)
    if not v then
      return freed
    end
    call('HDEL', K_HOLD, t)
    for _, c in ipairs(cjson.decode(v)) do
      if call('SREM', held_key(c[1]), t) == 1 then
        bump(K_ACTIVE, c[1], -1)
        freed[#freed + 1] = c[1]
      end
    end
    return freed
  end

  -- Every resource somebody waits for (the safety net's grant looks at them all).
  function R.waited_for()
    return call('ZRANGE', K_WAITING, 0, -1)
  end

  -- When a waiter's other key (its resource besides `r`; `solo` when it has none) was last
  -- served; -1: never.
  local function served_other(n, r)
    for _, c in ipairs(n.c) do
      if c[1] ~= r then
        return tonumber(call('HGET', K_SERVED, c[1]) or '-1')
      end
    end
    return tonumber(call('HGET', K_SOLO, r) or '-1')
  end

  -- Offer freed resources to their waiters, in any queue but those in the set `paused` (their
  -- waiters are passed over and keep their place). `gate(q, t)` takes t's slot in its queue q if
  -- that queue has room (true) or says no. Granted tickets are appended to `out`.
  function R.grant_freed(freed, gate, out, paused)
    local done = {}
    for _, r in ipairs(freed) do
      if not done[r] then
        done[r] = true
        local ceil = tonumber(call('HGET', K_CEIL, r) or '0')
        -- Page after page (one key's backlog of blocked calls must not hide another key's
        -- waiter that fits) while r has room, at most MAX_SCAN entries; each page is ranked.
        local from, read = '-', 0
        while R.active(r) < ceil and read < R.MAX_SCAN do
          local page = call('ZRANGEBYLEX', line_key(r), from, '+', 'LIMIT', 0, R.SCAN)
          if #page == 0 then
            break
          end
          read = read + #page
          from = '(' .. page[#page]
          local candidates = {}
          for _, m in ipairs(page) do
            local t = string.sub(m, 33)
            local n = R.need(t)
            if not n then
              call('ZREM', line_key(r), m) -- withdrawn without its line entry: tidy up
              bump(K_WAITING, r, -1)
            elseif not paused[n.q] then
              candidates[#candidates + 1] = { -n.p, served_other(n, r), n.a, t, n }
            end
          end
          table.sort(candidates, function(x, y)
            if x[1] ~= y[1] then return x[1] < y[1] end
            if x[2] ~= y[2] then return x[2] < y[2] end
            return x[3] < y[3]
          end)
          for _, cand in ipairs(candidates) do
            if R.active(r) >= ceil then
              break
            end
            local t, n = cand[4], cand[5]
            if R.fits(n.c) and gate(n.q, t) then
              R.take(t, n.c)
              out[#out + 1] = t
            end
          end
          if #page < R.SCAN then
            break
          end
        end
      end
    end
    return out
  end

  return R
end
