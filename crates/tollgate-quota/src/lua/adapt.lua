-- Adaptive quotas: the provider's real limit, learned from its 429s. The
-- specification, and its property tests, are `adaptive.rs` in tollgate-core;
-- these are the same steps in the same order, run inside the completion
-- that records each send, so every pod learns as one and learning costs no
-- round trip. (A test drives both with the same events and compares them.)
--
-- A quota hash with adaptive = '1' holds the ceiling (count, period_ms), the
-- minimum (min_count, min_period_ms), decrease, increase and probe_ms. Its
-- learning lives in the target's adapt hash: rate (per second), good, step,
-- trial (1 while the rate is a probe's first step above a settled rate,
-- which holds after two windows), resume (1 when the next probe resumes a
-- climb whose later step failed: no trial), failed (the lowest rate a step
-- of the climb under way failed at: its later steps stop short of it),
-- probe_at, probe_wait, cool, throttled, unproven (1 while no window has
-- held since that 429), win, n, changed, audited, audited_at (times in µs).

local ADAPT_WINDOW_US = 2000000
local ADAPT_STORM_US = 3 * ADAPT_WINDOW_US
local ADAPT_EXERCISED = 0.8
local ADAPT_AUDIT_CHANGE = 0.1
local ADAPT_AUDIT_EVERY_US = 10000000
-- Learning nobody has touched for a week is forgotten.
local ADAPT_TTL_MS = 604800000

-- The limits of an adaptive quota hash, or nil when it does not adapt.
local function adapt_limits(quota_key)
  local c = redis.call('HMGET', quota_key, 'adaptive', 'count', 'period_ms', 'min_count', 'min_period_ms',
    'decrease', 'increase', 'probe_ms')
  if c[1] ~= '1' then return nil end
  local n = {}
  for i = 2, 8 do
    n[i] = tonumber(c[i])
    if not n[i] or n[i] <= 0 then return nil end
  end
  return {ceiling = n[2] / (n[3] / 1000), min = n[4] / (n[5] / 1000), decrease = n[6], increase = n[7],
    probe = n[8] * 1000}
end

local ADAPT_FIELDS = {'rate', 'good', 'step', 'trial', 'resume', 'failed', 'probe_at', 'probe_wait', 'cool', 'throttled',
  'unproven', 'win', 'n', 'changed', 'audited', 'audited_at'}

local function adapt_load(key, l)
  local f = redis.call('HMGET', key, unpack(ADAPT_FIELDS))
  local s = {}
  for i, name in ipairs(ADAPT_FIELDS) do s[name] = tonumber(f[i]) end
  s.rate = s.rate or l.ceiling
  s.step, s.probe_at, s.probe_wait, s.cool = s.step or 0, s.probe_at or 0, s.probe_wait or 0, s.cool or 0
  s.n, s.changed, s.audited_at = s.n or 0, s.changed or 0, s.audited_at or 0
  return s
end

local function adapt_save(key, s)
  local set, gone = {}, {}
  for _, name in ipairs(ADAPT_FIELDS) do
    if s[name] == nil then
      gone[#gone + 1] = name
    else
      set[#set + 1] = name
      set[#set + 1] = string.format('%.17g', s[name])
    end
  end
  redis.call('HSET', key, unpack(set))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  redis.call('PEXPIRE', key, ADAPT_TTL_MS)
end

local function adapt_effective(l, s)
  return math.max(math.min(s.rate, l.ceiling), l.min)
end

local function adapt_set(s, new, old, now)
  s.rate = new
  if new == old then return false end
  s.changed = now
  return true
end

-- No probe up for a while: `probe`, or twice that after a failure that
-- followed a failure.
local function adapt_settle(l, s, now)
  s.step, s.failed = 0, nil
  s.probe_wait = math.min(math.max(s.probe_wait * 2, l.probe), 2 * l.probe)
  s.probe_at = now + s.probe_wait
end

-- A 429. Returns whether the rate changed.
local function adapt_throttled(l, s, now)
  if now < s.cool then return false end
  s.trial, s.resume = nil, nil
  local rate = adapt_effective(l, s)
  -- A storm: a second 429 within 6 s of the last, or before a window has
  -- held since it (a long Retry-After, or a slow quota's spacing, puts a
  -- falling limit's 429s further apart).
  local storm = s.unproven or (s.throttled and now < s.throttled + ADAPT_STORM_US)
  local new
  if s.good and s.good < rate then
    -- A probe above what held failed: back to it, and wait. Its 429 says
    -- nothing of the rate that held, so it does not start a storm.
    -- A climb's later step (one held since the last settling) leaves the
    -- limit between two rates more than a step apart: probe again from the
    -- one that held after a window. The settling still counts, so a failure
    -- of that probe waits the doubled time.
    local resume = s.probe_wait == 0 and rate > s.good * (1 + l.increase)
    adapt_settle(l, s, now)
    -- Below any rate that failed before it in this climb: its steps stop
    -- short of those.
    if resume then s.resume, s.probe_at, s.failed = 1, now + ADAPT_WINDOW_US, rate end
    new = s.good
    s.cool, s.win, s.n = now + ADAPT_WINDOW_US, now, 0
    return adapt_set(s, adapt_effective(l, {rate = new}), rate, now)
  elseif s.good and not storm then
    -- A lone 429 at a rate that held: it sits at the provider's edge, where
    -- send jitter alone crosses it. One step back: the inverse of a step up.
    new = adapt_effective(l, {rate = rate / (1 + l.increase)})
    s.good = new
    adapt_settle(l, s, now)
  else
    -- The limit fell (a storm), or nothing has held yet.
    s.good, s.failed, s.step, s.probe_wait, new = nil, nil, l.increase, 0, rate * l.decrease
  end
  s.throttled, s.unproven = now, 1
  -- The 429s answering sends made before this change are one burst.
  s.cool, s.win, s.n = now + ADAPT_WINDOW_US, now, 0
  return adapt_set(s, adapt_effective(l, {rate = new}), rate, now)
end

-- A send the provider accepted. Returns whether the rate changed.
local function adapt_sent(l, s, now)
  if not s.win then
    s.win, s.n = now, 0
    return false
  end
  local sent = s.n + 1
  local elapsed = math.max(now - s.win, 0)
  if elapsed < ADAPT_WINDOW_US then
    s.n = sent
    return false
  end
  s.win, s.n = now, 0
  local rate = adapt_effective(l, s)
  local used = sent * 1e6 / elapsed
  -- A rate the tenant does not use is never raised.
  if now < s.cool or used < ADAPT_EXERCISED * rate then return false end
  s.unproven = nil
  if s.trial then
    -- A probe's first step: its first window held, one more before it counts.
    s.trial = nil
    return false
  end
  s.good = rate
  if s.step == 0 then
    if now < s.probe_at then return false end
    s.step = l.increase
    -- Above a settled rate the first step is a trial; above a rate a climb
    -- held a window ago (its next step failed), not.
    if not s.resume then s.trial = 1 end
    s.resume = nil
  else
    -- The last step up held: a later failure waits `probe` afresh.
    s.probe_wait = 0
  end
  local new = adapt_effective(l, {rate = rate * (1 + s.step)})
  if s.failed and new >= s.failed then
    -- The limit lies between this rate, which held, and one that failed in
    -- this climb: stepping there again would only cross it again. Settle
    -- here, as after a failed probe.
    adapt_settle(l, s, now)
    return false
  end
  s.step = math.min(s.step * 2, 1)
  return adapt_set(s, new, rate, now)
end

-- The rate moved enough, long enough after the last entry, to be audited:
-- returns the rate the audit last showed and the new one.
local function adapt_audit(l, s, now)
  local rate = adapt_effective(l, s)
  local last, at = s.audited or l.ceiling, s.audited_at
  if not s.audited then at = 0 end
  if math.abs(rate - last) < ADAPT_AUDIT_CHANGE * last or now < at + ADAPT_AUDIT_EVERY_US then return nil end
  s.audited, s.audited_at = rate, now
  return last, rate
end

-- Millionths, as the replies carry rates (integers): 1/h is 278 of them.
local function adapt_micro(rate) return math.floor(rate * 1e6 + 0.5) end

-- One outcome for one adaptive target ('sent' or 'throttled'): learns from
-- it and returns the effective rate in millionths per second (-1 when the
-- quota does not adapt; then nothing else is read, not even the clock),
-- and, when the change is large enough to be audited, the rates the entry
-- shows (old, new, in millionths) and when (ms). The caller appends the
-- entry: the audit stream lives outside the target's slot.
local function adapt_learn(quota_key, adapt_key, outcome, now_override)
  local l = adapt_limits(quota_key)
  if not l then return -1 end
  local now = now_us(now_override)
  local s = adapt_load(adapt_key, l)
  if outcome == 'throttled' then adapt_throttled(l, s, now) else adapt_sent(l, s, now) end
  local last, rate = adapt_audit(l, s, now)
  adapt_save(adapt_key, s)
  local effective = adapt_micro(adapt_effective(l, s))
  if last then return effective, adapt_micro(last), adapt_micro(rate), math.floor(now / 1000) end
  return effective
end

-- The bucket of an adaptive quota: spaced at the effective rate, its places
-- re-spaced around the last change of it. `adaptive` is the quota hash's
-- field, already read with the quota: a quota that does not adapt costs
-- nothing more.
local function adapt_bucket(b, adaptive, quota_key, adapt_key, pacing)
  if not b or adaptive ~= '1' then return b end
  local l = adapt_limits(quota_key)
  if not l then return b end
  local s = adapt_load(adapt_key, l)
  b[1] = math.ceil(1e6 / adapt_effective(l, s) * pacing)
  if s.changed > b[3] then b[3] = s.changed end
  return b
end
