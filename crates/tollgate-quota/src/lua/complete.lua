-- After a provider call: record the idempotency key when the job was sent,
-- release the in-flight lease and the concurrency slot if this attempt still
-- holds them, and on a 429 push the tenant's bucket (or, when the route's
-- 429s are account-wide, the route's) past Retry-After so every pod backs
-- off, not only the one that saw it.
--
-- KEYS[1] sent record, KEYS[2] lease, KEYS[3] tenant in-flight zset,
-- KEYS[4] tenant penalty, KEYS[5] route penalty
-- ARGV[1] lease token, ARGV[2] '1' if sent, ARGV[3] record ttl ms,
-- ARGV[4] job id, ARGV[5] penalty microseconds ('0' = none),
-- ARGV[6] "now" override in microseconds, for tests only ("" = Redis TIME)
-- ARGV[7] whom the penalty pauses: "tenant" or "route"

if ARGV[2] == '1' then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[3])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
redis.call('ZREM', KEYS[3], ARGV[1])

local penalty = tonumber(ARGV[5])
if penalty > 0 then
  local until_us = now_us(ARGV[6]) + penalty
  local ttl = math.ceil(penalty / 1000) + 1000
  local key = KEYS[4]
  if ARGV[7] == 'route' then key = KEYS[5] end
  local current = tonumber(redis.call('GET', key))
  if not current or current < until_us then
    redis.call('SET', key, string.format('%.0f', until_us), 'PX', ttl)
  end
end
return 1
