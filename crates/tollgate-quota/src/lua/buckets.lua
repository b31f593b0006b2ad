-- A quota's GCRA bucket, as the permit scripts (`permit.lua`, `route.lua`)
-- read and keep it.

-- How far past the route's next free slot a send may be reserved, at least
-- (microseconds): room for the job to come back from its hold and ask again
-- (a timer, a batched round trip) before its slot.
local ROUTE_LEAD_US = 25000

-- How many kept places (`permit.lua`) a reservation steps over or moves at
-- most before it is refused.
local ROUTE_KEPT_STEPS = 16

-- A bucket: {interval, burst, changed_at, nil, period} or nil (no quota).
-- changed_at (microseconds) is when its quota last changed: places in line
-- are re-spaced around it. period: the quota's, microseconds. Sends are
-- spaced `pacing` wider than the quota.
local function quota_bucket(count, period_ms, burst, changed_ms, pacing, now)
  count, period_ms, burst = tonumber(count), tonumber(period_ms), tonumber(burst)
  if not (count and period_ms and burst) or count < 1 or period_ms < 1 or burst < 1 then return nil end
  local changed = tonumber(changed_ms)
  -- Whole microseconds, rounded up: times near 1.8e15 µs have no room for
  -- fractions in a double, and a rounded-down interval could send early.
  return {math.ceil(period_ms * 1000 / count * pacing), burst, changed and changed * 1000 or now, nil, period_ms * 1000}
end

-- The bucket's TAT (`raw`, as read), clamped so a quota change applies at
-- once (under a steady quota it never exceeds the clamp). Also returns the
-- TAT as stored (nil if none).
local function clamped_tat(raw, b, now, horizon)
  local stored = tonumber(raw)
  local tat = stored or now
  if tat < now then tat = now end
  local cap = now + horizon + b[1] * b[2]
  if tat > cap then tat = cap end
  return tat, stored
end

-- Sends spaced `pacing` wider than the quota leave the provider's window
-- (the quota's period) a slack of period × (pacing - 1): a send that leaves
-- later than that after its slot, with the send a period of sends later on
-- time, puts one more than the quota in a window. The call may begin up to
-- half of it late (microseconds); the other half is for the network's
-- jitter. Past it, the worker lets the permit go unused and asks again.
local function bucket_leeway(b, pacing)
  return b[5] * (pacing - 1) / 2
end
