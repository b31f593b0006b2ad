-- A route's side of a permit when the route's keys live in another hash slot
-- than the tenant's (a Redis Cluster): the calls `tollgate_core::cross_slot`
-- specifies, each atomic on the route's slot, with the tenant's decision
-- (`permit.lua`, given the time reserved here) between them. Called from
-- `batch.lua`.
--
-- The route's bucket is GCRA as in `permit.lua`, spaced at the learned rate
-- when the route's quota adapts, and held back by the route's penalty (an
-- account-wide 429). Send times reserved and given back are *holes*: a sorted
-- set of "<send time>:<interval>" by send time, filled by the next
-- reservation, for any tenant, while still ahead. A hole spaced at another
-- interval than the route's now is dropped (a quota change: the holes were
-- spaced at the old pace).

-- The route's bucket now (`buckets.lua`), and whether its quota adapts; nil
-- when the route has no quota.
local function route_bucket(quota_key, adapt_key, pacing, now)
  local r = redis.call('HMGET', quota_key, 'count', 'period_ms', 'burst', 'updated_at_ms', 'adaptive')
  local b = quota_bucket(r[1], r[2], r[3], r[4], pacing, now)
  return adapt_bucket(b, r[5], quota_key, adapt_key, pacing), r[5] == '1'
end

-- Reserves the route's earliest send time for a job, within the window: a
-- hole given back, or a time the bucket's pace allows no further than the
-- lead past its next free time.
--
-- The route's capacity divides among its tenants with work as on one Redis
-- (`shares.lua`): each has a line on the route, its places spaced by its
-- share. A fresh job whose tenant's next place is beyond the window is
-- given that place and comes back the window before it, so a tenant with a
-- few jobs is not queued behind another's backlog, and jobs wait their turn
-- instead of all asking each time a slot frees; otherwise it takes the
-- route's next free time and uses up its tenant's next place. A job back
-- with its place asks from it; one back for its place in its tenant's
-- line has had its turn there, and one back early for it (a hop's
-- remainder) keeps it and comes back the window before it. A slot of the
-- route left unused for a whole interval goes to whoever asks: shares
-- order a contended route, they never leave it idle.
--
-- Keys (8): route quota, route TAT, route holes, route penalty, route
-- adapt, the tenant's line on the route (its next free place, in the
-- route's virtual time), the route's tenants with work, their weights.
-- Arguments (9): not_before_us (the tenant's own place, on this clock, for
-- a job back from the tenant's line; 0 = none), window_us, pacing factor, horizon_us,
-- "now" override in microseconds (tests only; "" = Redis TIME), the job's
-- place on its tenant's line on the route (virtual; "" = none), the
-- tenant's name, its weight as its slot last told the pod ("" = 1), the
-- step (virtual) the job's place was given at ("" = unknown: today's).
--
-- Unlike on one Redis, a tenant held below its share by its own quota
-- counts with its whole weight here: the tenant's quota is in its own slot.
-- (Counting it for what it can use, from its spacing as the pod last
-- heard it, let two such tenants shrink each other's weights to nothing,
-- and when one left the other's weight jumped back a thousandfold, moving
-- every place of the route's virtual time as far out: 400 s.) The part of
-- its share it cannot use is refused by its slot and given back as holes,
-- or left to whoever asks once a route slot has gone unused.
-- Reply:
--   {0, delay, at, leeway, adaptive}  reserved: the send at now + delay = at
--                                     (microseconds); how late the call may
--                                     begin; 1 when the route's quota adapts
--   {1, retry_in, place, step, made}  nothing reserved: ask again then, for
--                                     that place on the route (virtual; 0:
--                                     none), its tenant's places `step` apart
--                                     (virtual); `retry_in` counts from
--                                     `made`, this decision's time (µs)
--   {7}                               the route has no quota; nothing reserved
--   {8, retry_in, 0, 0, made}         no quota, but an account-wide 429 holds
--                                     the route until then
local function reserve(k, a, now)
  local quota_key, tat_key, holes_key, penalty_key, adapt_key = k[1], k[2], k[3], k[4], k[5]
  local line_key, active_key, weights_key = k[6], k[7], k[8]
  local pacing = tonumber(a[3])
  local penalty = tonumber(redis.call('GET', penalty_key)) or 0
  local b, adaptive = route_bucket(quota_key, adapt_key, pacing, now)
  if not b then
    if penalty > now then return {8, penalty - now} end
    return {7}
  end
  local window, horizon = tonumber(a[2]), tonumber(a[4])
  local lead = math.max(b[1], ROUTE_LEAD_US)
  local tenant_name = a[7]
  redis.call('ZREMRANGEBYSCORE', holes_key, '-inf', '(' .. string.format('%.0f', now))

  local tat, stored = clamped_tat(redis.call('GET', tat_key), b, now, horizon)
  local free = math.max(tat - b[1] * (b[2] - 1), now, penalty)

  -- Paused, as its slot said on a send time given back (`route_give_back`):
  -- nothing reserved and not counted until the mark lapses (the pause's
  -- recheck), so its parked jobs asking again keep it off the route.
  local raw_line = redis.call('GET', line_key)
  local paused_until = tonumber(string.match(raw_line or '', '^paused (%S+)$'))
  if paused_until and paused_until > now then return {1, math.ceil(paused_until - now), 0, 0} end
  if paused_until then raw_line = nil end
  local clock, total, _, others = share_clock(weights_key, active_key, tenant_name, tonumber(a[8]) or 1, 1, b[1],
    now)
  local spacing = clock.step * total
  local line = clock.line(raw_line)
  local idle = (stored or 0) + b[1] <= now and free <= now
  local place_v = tonumber(a[6])
  local not_before = tonumber(a[1])
  -- Alone on an idle route, a place on its share line orders nobody: the
  -- job goes now, as a fresh one (as on one Redis, `permit.lua`).
  if place_v and idle and others == 0 then place_v, not_before = nil, 0 end
  if place_v then place_v = clock.place(place_v, tonumber(a[9])) end
  local place = place_v and clock.real(place_v)
  -- A job back for its place on its tenant's line (`not_before`), not for
  -- one on the route's.
  local returning = not place and not_before > 0
  local start = math.max(place or not_before, now, penalty)

  -- The tenant counts among the route's tenants with work for a spacing
  -- after each call, and while it has places ahead.
  local function count()
    local until_at = now + spacing
    if line and line > until_at then until_at = line end
    share_count(weights_key, active_key, tenant_name, until_at, now)
  end
  local function push(next_at)
    redis.call('SET', line_key, clock.head(next_at), 'PX',
      math.ceil((next_at - now) / 1000) + 1000)
    line = next_at
  end
  -- Denied, for the place `at` (real time now): the job comes back `ahead`
  -- before it, or before `due` (the soonest that place can come).
  local function denied(at, ahead, due)
    count()
    return {1, math.max(math.ceil((due or at) - now - ahead), 0), math.floor(clock.virtual(at)),
      math.ceil(clock.step)}
  end
  -- Hands out the tenant's next place on the route.
  local function queue()
    local at = math.max(line or 0, free, start)
    push(at + spacing)
    return denied(at, window, clock.soonest(at))
  end
  -- Back early (a hop's remainder) for its place on its tenant's line: it
  -- keeps that place and comes back when it is within the window. Handed
  -- its tenant's next place on the route instead, as a fresh job, it lost
  -- its turn: a 10/s tenant beside one that could take a 30/s route sent
  -- 7.6/s and went up to 0.87 s without a send (8.4/s and 0.36 s since).
  if returning and start > now + window then
    count()
    return {1, math.ceil(start - window - now), 0, 0}
  end
  -- A fresh job waits for its turn on its tenant's share of the route; a
  -- job back for its place has waited its turn in its tenant's line.
  if not place and not returning and not idle and line and line > now + window then return queue() end

  -- The first hole from `start` at today's spacing (others go).
  local hole, hole_member = nil, nil
  local hole_spacing = string.format('%.0f', b[1])
  while true do
    local first = redis.call('ZRANGEBYSCORE', holes_key, string.format('%.0f', start), '+inf', 'WITHSCORES',
      'LIMIT', 0, 1)
    if #first == 0 then break end
    if string.match(first[1], ':(%d+)$') == hole_spacing then
      hole, hole_member = tonumber(first[2]), first[1]
      break
    end
    redis.call('ZREM', holes_key, first[1])
  end
  local paced = nil
  if start <= free + lead then paced = math.max(start, free) end
  local earliest = hole
  if paced and (not earliest or paced < earliest) then earliest = paced end
  if not earliest then
    -- Reserving `start` far past the next free time would leave the slots
    -- between to nobody: come back `lead` before it, with it as a place
    -- (else it would be sought a window later again).
    local at = math.max(start, now + lead + 1000)
    return denied(at, lead, place and clock.soonest(at))
  end
  if earliest > now + window then
    -- Busy past the window: a job with a place keeps it; one without takes
    -- its tenant's next.
    if place then
      count()
      return {1, math.ceil(earliest - window - now), math.floor(place_v), math.ceil(clock.step)}
    end
    return queue()
  end
  if earliest == hole then
    redis.call('ZREM', holes_key, hole_member)
  else
    local next_tat = math.ceil(math.max(tat, earliest) + b[1])
    redis.call('SET', tat_key, string.format('%d', next_tat), 'PX', math.ceil((next_tat - now) / 1000) + 1000)
  end
  -- The send used a place of the tenant's share: a fresh job the next one
  -- (so a tenant whose jobs ask often cannot take free slots beyond its
  -- share); for a job back for its place, the line is already past it.
  if not place then
    push(math.max(line or now, now) + spacing)
  elseif not line or line < now + spacing then
    push(now + spacing)
  end
  count()
  earliest = math.ceil(earliest)
  local adapts = 0
  if adaptive then adapts = 1 end
  return {0, earliest - now, earliest, math.floor(bucket_leeway(b, pacing)), adapts}
end

-- `reserve`, its denials stamped with when they were made: the pod counts
-- a denial's wait from then, as it does a grant's send time, not from when
-- it read the reply.
local function route_reserve(k, a)
  local now = now_us(a[5])
  local reply = reserve(k, a, now)
  if reply[1] == 1 or reply[1] == 8 then
    reply[3], reply[4], reply[5] = reply[3] or 0, reply[4] or 0, math.floor(now)
  end
  return reply
end

-- Gives back a send time reserved and not used (the tenant refused it, or
-- the job was a duplicate, cancelled, ...). One already past is dropped: a
-- send in it now would be late.
--
-- A paused tenant (its slot said so) leaves the route (`share_leave`), as
-- on one Redis, and its line on the route is marked paused for the pause's
-- recheck.
--
-- Keys (5): route holes, route quota, route adapt, the tenant's line on the
-- route, the route's tenants with work. Arguments (5): the send time
-- (microseconds), pacing factor, "now" override ("" = Redis TIME), the
-- tenant's name when it is paused ("" = not), the pause's recheck
-- (microseconds).
-- Reply: {1} given back, {0} dropped.
local function route_give_back(k, a)
  local now = now_us(a[3])
  if a[4] ~= '' then
    share_leave(k[5], a[4], now)
    local recheck = tonumber(a[5])
    redis.call('SET', k[4], 'paused ' .. string.format('%.0f', now + recheck), 'PX', math.ceil(recheck / 1000) + 1000)
  end
  local at = tonumber(a[1])
  local b = route_bucket(k[2], k[3], tonumber(a[2]), now)
  if not b or at < now then return {0} end
  -- Marked with the spacing it was given at: a reservation drops a hole
  -- spaced otherwise (the quota, or what it learned, changed since).
  redis.call('ZADD', k[1], string.format('%.0f', at), string.format('%.0f:%.0f', at, b[1]))
  local ttl = math.ceil((at - now) / 1000) + 1000
  if redis.call('PTTL', k[1]) < ttl then redis.call('PEXPIRE', k[1], ttl) end
  return {1}
end

-- A route's side of a completion: on an account-wide 429, the route's
-- penalty; and what the route's adaptive quota learns from the outcome.
--
-- Keys (3): route penalty, route quota, route adapt. Arguments (3): penalty
-- microseconds ('0' = none), "now" override ("" = Redis TIME), what the
-- route learns ('sent', 'throttled', '' = nothing).
-- Reply: {1, route's effective rate, audit old, new, audit at} as
-- `complete.lua`'s.
local function route_complete(k, a)
  local penalty = tonumber(a[1])
  if penalty > 0 then
    local until_us = now_us(a[2]) + penalty
    local current = tonumber(redis.call('GET', k[1]))
    if not current or current < until_us then
      redis.call('SET', k[1], string.format('%.0f', until_us), 'PX', math.ceil(penalty / 1000) + 1000)
    end
  end
  local r = {-1}
  if a[3] ~= '' then r = {adapt_learn(k[2], k[3], a[3], a[2])} end
  return {1, r[1], r[2] or -1, r[3] or -1, r[4] or 0}
end
