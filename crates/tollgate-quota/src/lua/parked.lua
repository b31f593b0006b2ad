-- Counts tenants' parked copies (in a delay tier) by why they wait and when
-- they come back, for the console: the copies parked right now are the
-- counts due back after now. Nothing is decremented, so a pod that dies
-- between publishing a copy and counting it leaves nothing to undo.
--
-- KEYS[i]  tenant i's parked hash: "<reason>:<bucket, unix ms>" -> copies
-- ARGV, for each tenant in turn: the seconds its hash must live on (past
-- its furthest return), n, then n pairs of field and copies to add.

local now_ms = math.floor(now_us(nil) / 1000)
local a = 1
for _, key in ipairs(KEYS) do
  local keep, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  for i = a + 2, a + 2 * n, 2 do
    redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
  end
  a = a + 2 + 2 * n

  -- Buckets whose copies have come back are dropped every 5 s at most.
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

  if redis.call('TTL', key) < keep then
    redis.call('EXPIRE', key, keep)
  end
end
return 0
