-- After a provider call: record the idempotency key if the job was sent,
-- release the in-flight lease and the concurrency slot if that attempt
-- still holds them, and on a 429 push the tenant's bucket (or, when the
-- route's 429s are account-wide, the route's) past Retry-After so every pod
-- backs off, not only the one that saw it. Called from `batch.lua`.
--
-- Keys (5): sent record, lease, tenant in-flight zset, tenant penalty,
-- route penalty.
-- Arguments (7): lease token, '1' if sent, record ttl ms, job id,
-- penalty microseconds ('0' = none), "now" override in microseconds (tests
-- only; "" = Redis TIME), whom the penalty pauses ("tenant" or "route").

local function complete(k, a)
  if a[2] == '1' then
    redis.call('SET', k[1], a[4], 'PX', a[3])
  end
  if redis.call('GET', k[2]) == a[1] then
    redis.call('DEL', k[2])
  end
  redis.call('ZREM', k[3], a[1])

  local penalty = tonumber(a[5])
  if penalty > 0 then
    local until_us = now_us(a[6]) + penalty
    local ttl = math.ceil(penalty / 1000) + 1000
    local key = k[4]
    if a[7] == 'route' then key = k[5] end
    local current = tonumber(redis.call('GET', key))
    if not current or current < until_us then
      redis.call('SET', key, string.format('%.0f', until_us), 'PX', ttl)
    end
  end
end
