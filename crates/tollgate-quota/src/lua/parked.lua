-- Counts a tenant's parked copies (in a delay tier) by why they wait and
-- when they come back, for the console: the copies parked right now are the
-- counts due back after now. Nothing is decremented, so a pod that dies
-- between publishing a copy and counting it leaves nothing to undo.
--
-- KEYS[1]  the tenant's parked hash: "<reason>:<bucket, unix ms>" -> copies
-- ARGV[1]  seconds the hash must live on (past the furthest return)
-- ARGV[2], ARGV[3], ...  field, copies to add; repeated

local key = KEYS[1]
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
end

-- Buckets whose copies have come back are dropped every 5 s at most.
local now_ms = math.floor(now_us(nil) / 1000)
local pruned = tonumber(redis.call('HGET', key, 'pruned') or '0')
if pruned < now_ms - 5000 then
  for _, field in ipairs(redis.call('HKEYS', key)) do
    local at = tonumber(string.match(field, ':(%d+)$'))
    if at and at <= now_ms then
      redis.call('HDEL', key, field)
    end
  end
  redis.call('HSET', key, 'pruned', now_ms)
end

local keep = tonumber(ARGV[1])
if redis.call('TTL', key) < keep then
  redis.call('EXPIRE', key, keep)
end
return 0
