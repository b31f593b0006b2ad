-- One fleet-wide permit decision, atomically: idempotency check, in-flight
-- lease, then GCRA on the tenant's quota with a bounded reservation.
--
-- KEYS[1] quota hash    (count, period_ms, burst)
-- KEYS[2] tat           (GCRA theoretical arrival time, microseconds)
-- KEYS[3] sent record   (present = already sent)
-- KEYS[4] lease         (holder token of the in-flight lease)
-- KEYS[5] virtual queue (hash: at = next free virtual slot, iv = its interval)
-- ARGV[1..3] default quota: count, period_ms, burst (tenant has no quota)
-- ARGV[4] lease token of this attempt
-- ARGV[5] reservation horizon, microseconds
-- ARGV[6] lease ttl, milliseconds (provider timeout + margin)
-- ARGV[7] pacing factor (1.02 = pace 2 % under the quota, so send jitter
--         never puts rate + 1 requests in a provider's one-second window)
--
-- Reply {code, micros}:
--   {0, delay}    granted: send at now + delay (delay <= horizon)
--   {1, retry_in} denied: ask again in retry_in (this job's own virtual slot)
--   {2, 0}        duplicate: already sent
--   {3, retry_in} another copy holds the lease

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

if redis.call('EXISTS', KEYS[3]) == 1 then
  return {2, 0}
end

local holder = redis.call('GET', KEYS[4])
if holder and holder ~= ARGV[4] then
  local ttl = redis.call('PTTL', KEYS[4])
  if ttl < 1 then ttl = 1 end
  return {3, ttl * 1000}
end

local q = redis.call('HMGET', KEYS[1], 'count', 'period_ms', 'burst')
local count, period_ms, burst = tonumber(q[1]), tonumber(q[2]), tonumber(q[3])
if not (count and period_ms and burst) or count < 1 or burst < 1 then
  count, period_ms, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
end
local interval = period_ms * 1000 / count * tonumber(ARGV[7])
local horizon = tonumber(ARGV[5])

local tat = tonumber(redis.call('GET', KEYS[2])) or now
if tat < now then tat = now end
-- Under a steady quota tat never exceeds this bound; after a quota change it
-- can, and clamping applies the new rate at once instead of draining the old
-- schedule first.
local cap = now + horizon + interval * burst
if tat > cap then tat = cap end

local delay = tat - interval * (burst - 1) - now
if delay < 0 then delay = 0 end
if delay > horizon then
  -- Denied. Give the job its own place in the tenant's virtual queue, so
  -- denied jobs come back one interval apart, each when its slot is about to
  -- open, instead of all at once (which would make them spin). The place is
  -- not a reservation: the job asks again when it returns.
  local v = redis.call('HMGET', KEYS[5], 'at', 'iv')
  local vat, viv = tonumber(v[1]), tonumber(v[2])
  if vat and viv and viv > 0 and math.abs(viv - interval) > 0.5 then
    -- The quota changed: re-space the waiting jobs at the new rate.
    vat = now + (vat - now) * interval / viv
  end
  if not vat or vat < tat then vat = tat end
  local next_vat = vat + interval
  redis.call('HSET', KEYS[5], 'at', string.format('%.0f', next_vat), 'iv', string.format('%.3f', interval))
  redis.call('PEXPIRE', KEYS[5], math.ceil((next_vat - now) / 1000) + 1000)
  local retry_in = vat - interval * (burst - 1) - now - horizon
  if retry_in < 0 then retry_in = 0 end
  return {1, math.ceil(retry_in)}
end

local new_tat = tat + interval
redis.call('SET', KEYS[2], string.format('%.0f', new_tat),
  'PX', math.ceil((new_tat - now) / 1000) + 1000)
redis.call('SET', KEYS[4], ARGV[4], 'PX', tonumber(ARGV[6]) + math.ceil(delay / 1000))
return {0, math.floor(delay)}
