-- durable_flow fleet-wide admission: one instance's heartbeat (after `hearing.lua`).
-- KEYS[1] the instance's heartbeat key, KEYS[2] P:fleet; ARGV[1] its value, ARGV[2] the TTL (ms).
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
fleet_heard_for(redis.call, KEYS[2], tonumber(ARGV[2]))
return 1
