-- Step-concurrency resources for the Redis admission backend: the rules of `resources.py`, in Lua.
--
-- This file is not a script of its own: `redis_resources.script_source()` puts it in front of
-- admission.lua, so one EVALSHA decides a call's queue slot and its resource slots together
-- (all or none), and a release hands freed resources to their waiters in the same call.
--
-- Key layout (P = KEY_PREFIX, r = a resource name such as `sc:fn:<workflow>:<key>`):
--
--   P:res:<r>:held  set    tickets holding a slot of r (SCARD = r's active count)
--   P:res:<r>:k:<g> zset   the waiters of r whose other key is g (`''`: those needing r alone),
--                          score 0, member P(priority) .. A(arrival) .. ticket (lexicographic
--                          order = priority first, then arrival: FIFO within a key)
--   P:res:<r>:heads zset   each key's head: score 0, member P .. S(its last serve) .. A .. g, so
--                          the first member is the best head; S may lag (serves only grow), and
--                          is brought up to date when the member surfaces
--   P:res:<r>:headof hash  g -> its member in heads
--   P:res:<r>:line  zset   r's whole line as an earlier version kept it: moved to the key lines
--                          by r's next offer, then deleted
--   P:res:hold      hash   ticket -> JSON [[r, limit], ...] it holds
--   P:res:need      hash   ticket -> JSON {q = queue, p = priority, a = arrival, c = [[r, limit], ...]}
--   P:res:ceil      hash   r -> the highest limit among its waiters (a freed r is offered
--                          until it is full for all of them)
--   P:res:active    zset   r -> active count, only while > 0 (the busiest keys, for the dashboard)
--   P:res:waiting   zset   r -> waiting count, only while > 0
--   P:res:served    hash   r -> serve number of its last grant (least-recently-served key first)
--   P:res:solo      hash   r -> serve number of the last grant of r to a call with no other resource
--   P:res:meta      hash   counters `arrival` and `serve`
--
-- Fairness across keys: a freed resource goes to the best key head, by priority, then the last
-- serve of the waiter's *other* resource (e.g. its account's key under a shared ceiling; least
-- recently served first), then arrival, so one key's backlog on a shared resource cannot starve
-- the other keys; each grant re-ranks its key. Calls that need the shared resource alone form one
-- more key of their own (`''`), served in turn with the others. Within one key the order stays
-- arrival (FIFO). The work of a grant is O(log n) per key head looked at, whatever the backlog.
--
-- Resource keys are named inside the script (as the heartbeat keys are), under the prefix the
-- call's keys carry: on Redis Cluster that prefix is a shard's hash tag, so a resource lives in
-- one shard with the queues whose calls need it (see `shards.py`).

local function new_resources(prefix, call)
  local R = { MAX_SCAN = 5000 } -- resources.py's MAX_SCAN
  local K_HOLD, K_NEED, K_CEIL = prefix .. ':res:hold', prefix .. ':res:need', prefix .. ':res:ceil'
  local K_ACTIVE, K_WAITING = prefix .. ':res:active', prefix .. ':res:waiting'
  local K_SERVED, K_SOLO, K_META = prefix .. ':res:served', prefix .. ':res:solo', prefix .. ':res:meta'

  local function held_key(r) return prefix .. ':res:' .. r .. ':held' end
  local function key_line(r, g) return prefix .. ':res:' .. r .. ':k:' .. g end
  local function heads_key(r) return prefix .. ':res:' .. r .. ':heads' end
  local function headof_key(r) return prefix .. ':res:' .. r .. ':headof' end
  -- A resource's whole line before the key lines (read once by `upgrade`, then deleted).
  local function old_line(r) return prefix .. ':res:' .. r .. ':line' end
  local function pad(n) return string.format('%016d', n) end
  local function member(p, a, t) return pad(5e15 - p) .. pad(a) .. t end

  -- The key a waiter of r is ranked by: its other resource, or '' when it needs r alone.
  local function key_of(cs, r)
    for _, c in ipairs(cs) do
      if c[1] ~= r then
        return c[1]
      end
    end
    return ''
  end

  -- When key g of r's line was last served (-1: never).
  local function served_of(r, g)
    if g == '' then
      return tonumber(call('HGET', K_SOLO, r) or '-1')
    end
    return tonumber(call('HGET', K_SERVED, g) or '-1')
  end

  -- Bring key g's member in r's heads up to date (its first waiter, its last serve), or drop it.
  local function refresh(r, g)
    local first = call('ZRANGE', key_line(r, g), 0, 0)
    local old = call('HGET', headof_key(r), g)
    local new = first[1] and (string.sub(first[1], 1, 16) .. pad(served_of(r, g) + 1) .. string.sub(first[1], 17, 32) .. g)
    if new == old then
      return
    end
    if old then
      call('ZREM', heads_key(r), old)
    end
    if new then
      call('ZADD', heads_key(r), 0, new)
      call('HSET', headof_key(r), g, new)
    else
      call('HDEL', headof_key(r), g)
    end
  end

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

  -- The first constraint of cs with no room (its index in cs), or nil: `base.first_full`.
  function R.first_full(cs)
    for i, c in ipairs(cs) do
      if call('SCARD', held_key(c[1])) >= c[2] then
        return i
      end
    end
    return nil
  end

  -- Whether every constraint has room for one more, each against its own limit.
  function R.fits(cs)
    return R.first_full(cs) == nil
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
      local g = key_of(n.c, c[1])
      local m = member(n.p, n.a, t)
      if call('ZREM', key_line(c[1], g), m) == 1 or call('ZREM', old_line(c[1]), m) == 1 then
        bump(K_WAITING, c[1], -1)
        refresh(c[1], g)
        if call('EXISTS', heads_key(c[1])) == 0 and call('EXISTS', old_line(c[1])) == 0 then
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
      local g = key_of(cs, c[1])
      call('ZADD', key_line(c[1], g), 0, member(p, a, t))
      refresh(c[1], g)
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

  -- Every resource somebody waits for, by name (the safety net's grant looks at them all).
  function R.waited_for()
    local names = call('ZRANGE', K_WAITING, 0, -1)
    table.sort(names)
    return names
  end

  -- Whether waiter n of r is blocked by its own key (its other resource is full at its limit):
  -- then the key's later calls are passed over with it.
  local function key_full(n, r)
    local g = key_of(n.c, r)
    for _, c in ipairs(n.c) do
      if g ~= '' and c[1] == g and R.active(g) >= c[2] then
        return true
      end
    end
    return false
  end

  -- Offer freed resource r to its waiters, best key head first (`resource_line.py`'s order), in
  -- any queue but those in the set `paused`. `gate(q, t)` takes t's slot in its queue q if that
  -- queue has room (true) or says no. A head whose own key is full passes over its whole key for
  -- this offer; one of a paused queue, or one another gate blocks, is passed over alone (out of
  -- its key's line until the offer ends, so the key's next call competes). At most MAX_SCAN are
  -- passed over. Granted tickets are appended to `out`.
  -- Waiters parked by the script before key lines existed: move them to their key's line.
  local function upgrade(r)
    if call('EXISTS', old_line(r)) == 0 then
      return
    end
    for _, m in ipairs(call('ZRANGE', old_line(r), 0, -1)) do
      local n = R.need(string.sub(m, 33))
      if n then
        call('ZADD', key_line(r, key_of(n.c, r)), 0, m)
        refresh(r, key_of(n.c, r))
      end
    end
    call('DEL', old_line(r))
  end

  local function offer(r, gate, out, paused)
    local ceil = tonumber(call('HGET', K_CEIL, r) or '0')
    if R.active(r) >= ceil then
      return -- nobody waiting fits (or nobody waits)
    end
    upgrade(r)
    local aside, skipped, touched, passed = {}, {}, {}, 0
    while R.active(r) < ceil and passed < R.MAX_SCAN do
      local top = call('ZRANGE', heads_key(r), 0, 0)[1]
      if not top then
        break
      end
      local g = string.sub(top, 49)
      if tonumber(string.sub(top, 17, 32)) ~= served_of(r, g) + 1 then
        refresh(r, g) -- served since it was ranked: re-rank it
      else
        local m = call('ZRANGE', key_line(r, g), 0, 0)[1]
        local t = m and string.sub(m, 33)
        local n = m and R.need(t)
        if not m then
          refresh(r, g) -- a head without a line: drop it
        elseif not n then
          call('ZREM', key_line(r, g), m) -- withdrawn without its line entry: tidy up
          bump(K_WAITING, r, -1)
          refresh(r, g)
        elseif not paused[n.q] and key_full(n, r) then
          passed = passed + 1
          call('ZREM', heads_key(r), top)
          call('HDEL', headof_key(r), g)
          skipped[#skipped + 1] = g
        elseif not paused[n.q] and R.fits(n.c) and gate(n.q, t) then
          R.take(t, n.c)
          out[#out + 1] = t
        else
          passed = passed + 1
          call('ZREM', key_line(r, g), m)
          refresh(r, g)
          aside[#aside + 1] = { g, m }
        end
      end
    end
    for _, e in ipairs(aside) do
      call('ZADD', key_line(r, e[1]), 0, e[2])
      touched[e[1]] = true
    end
    for _, g in ipairs(skipped) do
      touched[g] = true
    end
    for g in pairs(touched) do
      refresh(r, g)
    end
    if next(touched) and not call('HGET', K_CEIL, r) then
      call('HSET', K_CEIL, r, ceil) -- emptied while its waiters were set aside
    end
  end

  -- Offer freed resources to their waiters (`offer`, once per resource).
  function R.grant_freed(freed, gate, out, paused)
    local done = {}
    for _, r in ipairs(freed) do
      if not done[r] then
        done[r] = true
        offer(r, gate, out, paused)
      end
    end
    return out
  end

  return R
end
