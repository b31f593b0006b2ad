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
-- The tenant's figures (its stats, for the console) are not counted here:
-- each pod tallies its calls and adds them every half second
-- (`outcomes.lua`).
--
-- Keys (9): sent record, lease, tenant in-flight zset, tenant penalty,
-- route penalty, tenant quota, tenant adapt, route quota, route adapt.
-- Arguments (8): lease token, '1' if sent ('0' the call failed, 'u' it timed
-- out unanswered, '' no call was made: the permit is released unused),
-- record ttl ms, job id, penalty
-- microseconds ('0' = none, else a 429), "now" override in microseconds
-- (tests only; "" = Redis TIME), whom the penalty pauses ("tenant",
-- "route", or "elsewhere": the route, from its own slot), and for a failed
-- call the milliseconds its Retry-After asked ('' = none).
-- Reply: {1, tenant's effective rate, route's effective rate, tenant audit
-- old, new, route audit old, new, audit at}: rates in millionths per
-- second, -1 where the quota does not adapt; an adjustment to audit (old
-- and new rate, -1 when none) and when (ms). The caller appends the
-- entries: the audit stream lives outside the tenant's slot.

local function complete(k, a)
  if a[2] == '1' then
    redis.call('SET', k[1], a[4], 'PX', a[3])
  end
  -- What this attempt's permit did (`lease_parts`); nil: not known (its
  -- lease expired or went to another attempt), so everything is done.
  local holder, marks = lease_parts(redis.call('GET', k[2]))
  local unanswered = a[2] == 'u'
  local hold = tonumber(a[8])
  if holder == a[1] then
    if a[2] == '0' and hold and hold > 0 then
      -- A failure that said when to call again (a 503's Retry-After): the
      -- lease stays that long, marked 'x' like an unanswered call's, so no
      -- copy of the job calls before it, this job's own included. Its
      -- parked copy carries the wait too, but a copy redelivered because
      -- the park's confirm was lost with the connection did not: it was
      -- called 2 s after a `Retry-After: 4`.
      redis.call('SET', k[2], holder .. '/' .. (marks or '') .. 'x', 'PX', hold)
    elseif unanswered then
      -- The provider may still be working on the call: the lease (and the
      -- concurrency slot) stay until they expire, marked 'x' so that this
      -- job's own token is kept out too (`permit.lua`).
      redis.call('SET', k[2], holder .. '/' .. (marks or '') .. 'x', 'KEEPTTL')
    else
      redis.call('DEL', k[2])
    end
  else
    marks = nil
  end
  local function did(mark) return not marks or string.find(marks, mark, 1, true) ~= nil end
  if did('c') and not unanswered then redis.call('ZREM', k[3], a[1]) end

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
  return {1, t[1], r[1], t[2] or -1, t[3] or -1, r[2] or -1, r[3] or -1, t[4] or r[4] or 0}
end
