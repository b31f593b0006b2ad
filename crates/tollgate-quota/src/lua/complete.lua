-- After a provider call: record the idempotency key if the job was sent,
-- release the in-flight lease and the concurrency slot if that attempt
-- still holds them, and on a 429 push the tenant's bucket (or, when the
-- route's 429s are account-wide, the route's) past Retry-After so every pod
-- backs off, not only the one that saw it. An adaptive quota (the
-- tenant's, the route's) learns from the outcome (`adapt.lua`): a 429
-- lowers the quota it is blamed on (the route's when its 429s are
-- account-wide or the tenant's does not adapt), a send counts for both.
-- Called from `batch.lua`.
--
-- Every outcome is also counted in the tenant's stats (a ring of 10 s
-- buckets over 5 minutes, for the console; see `STATS_*` below).
--
-- Keys (10): sent record, lease, tenant in-flight zset, tenant penalty,
-- route penalty, tenant quota, tenant adapt, route quota, route adapt,
-- tenant stats.
-- Arguments (8): lease token, '1' if sent ('0' the call failed, '' no call
-- was made: the permit is released unused), record ttl ms, job id, penalty
-- microseconds ('0' = none, else a 429), "now" override in microseconds
-- (tests only; "" = Redis TIME), whom the penalty pauses ("tenant",
-- "route", or "elsewhere": the route, from its own slot), the job's due
-- lag in milliseconds (its first attempt only; "" = none).
-- Reply: {1, tenant's effective rate, route's effective rate, stats bucket
-- begun, tenant audit old, new, route audit old, new, audit at}: rates in
-- thousandths per second, -1 where the quota does not adapt; the second
-- (10 s of Redis time) of a stats bucket this completion began, else 0; an
-- adjustment to audit (old and new rate, -1 when none) and when (ms). The
-- caller marks the tenant active and appends the entries: the active-tenant
-- index and the audit stream live outside the tenant's slot.

-- The stats ring: bucket b (10 s of Redis time) lives in slot b % 32 as
-- fields `b<slot>` (which bucket it holds), `s<slot>` sends, `t<slot>` 429s,
-- `f<slot>` other failures. A slot still holding an older bucket is reset
-- before it counts, so the hash never grows past 128 fields.
--
-- Due lags, for a fleet-wide p95: minute m lives in slot m % 6 as `m<slot>`
-- (which minute it holds) and `L<slot>.<bin>` counts, bin i counting lags up
-- to STATS_LAG_MS[i] (bin 10: longer). 66 fields at most.
--
-- The hash expires 10 minutes after the last bucket began: the expiry is
-- renewed with each reset (once per 10 s while the tenant sends), not with
-- each count. The reset is reported, so the caller marks the tenant active
-- then (a sorted set by when, trimmed to those 10 minutes), and the console
-- finds tenants with traffic but no stored quota.
local STATS_BUCKET_S, STATS_SLOTS, STATS_TTL_S = 10, 32, 600
local STATS_LAG_MS = {10, 50, 100, 250, 500, 1000, 2500, 5000, 10000}
local STATS_MINUTES = 6

-- Counts one outcome; returns the second a stats bucket began when this
-- count began it, else 0.
local function count_outcome(stats_key, outcome, lag_ms, now)
  local bucket = math.floor(now / 1e6 / STATS_BUCKET_S)
  local slot = tostring(bucket % STATS_SLOTS)
  local minute = math.floor(now / 6e7)
  local lag_slot = tostring(minute % STATS_MINUTES)
  local held = redis.call('HMGET', stats_key, 'b' .. slot, 'm' .. lag_slot)
  local began = 0
  if tonumber(held[1]) ~= bucket then
    redis.call('HSET', stats_key, 'b' .. slot, bucket, 's' .. slot, 0, 't' .. slot, 0, 'f' .. slot, 0)
    redis.call('EXPIRE', stats_key, STATS_TTL_S)
    began = bucket * STATS_BUCKET_S
  end
  redis.call('HINCRBY', stats_key, outcome .. slot, 1)
  if not lag_ms then return began end
  if tonumber(held[2]) ~= minute then
    local reset = {'m' .. lag_slot, minute}
    for bin = 1, #STATS_LAG_MS + 1 do
      reset[#reset + 1] = 'L' .. lag_slot .. '.' .. bin
      reset[#reset + 1] = 0
    end
    redis.call('HSET', stats_key, unpack(reset))
  end
  local bin = #STATS_LAG_MS + 1
  for i, bound in ipairs(STATS_LAG_MS) do
    if lag_ms <= bound then bin = i break end
  end
  redis.call('HINCRBY', stats_key, 'L' .. lag_slot .. '.' .. bin, 1)
  return began
end

local function complete(k, a)
  if a[2] == '1' then
    redis.call('SET', k[1], a[4], 'PX', a[3])
  end
  -- What this attempt's permit did (`lease_parts`); nil: not known (its
  -- lease expired or went to another attempt), so everything is done.
  local holder, marks = lease_parts(redis.call('GET', k[2]))
  if holder == a[1] then
    redis.call('DEL', k[2])
  else
    marks = nil
  end
  local function did(mark) return not marks or string.find(marks, mark, 1, true) ~= nil end
  if did('c') then redis.call('ZREM', k[3], a[1]) end

  local penalty = tonumber(a[5])
  -- 'elsewhere': the route's 429s are account-wide and its keys live in
  -- another slot, whose own call (`route.lua`) records the penalty.
  if penalty > 0 and a[7] ~= 'elsewhere' then
    local until_us = now_us(a[6]) + penalty
    local ttl = math.ceil(penalty / 1000) + 1000
    local key = k[4]
    if a[7] == 'route' then key = k[5] end
    local current = tonumber(redis.call('GET', key))
    if not current or current < until_us then
      redis.call('SET', key, string.format('%.0f', until_us), 'PX', ttl)
    end
  end

  -- Each learns (rate, audit old, audit new, audit at); see `adapt_learn`.
  local t, r = {-1}, {-1}
  if penalty > 0 then
    if a[7] == 'tenant' and did('t') then
      t = {adapt_learn(k[6], k[7], 'throttled', a[6])}
    end
    if t[1] < 0 and did('r') then
      r = {adapt_learn(k[8], k[9], 'throttled', a[6])}
    end
  elseif a[2] == '1' then
    if did('t') then t = {adapt_learn(k[6], k[7], 'sent', a[6])} end
    if did('r') then r = {adapt_learn(k[8], k[9], 'sent', a[6])} end
  end
  local began = 0
  if a[2] ~= '' then
    local outcome = 'f'
    if penalty > 0 then outcome = 't' elseif a[2] == '1' then outcome = 's' end
    began = count_outcome(k[10], outcome, tonumber(a[8]), now_us(a[6]))
  end
  return {1, t[1], r[1], began, t[2] or -1, t[3] or -1, r[2] or -1, r[3] or -1, t[4] or r[4] or 0}
end
