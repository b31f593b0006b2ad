-- How far ahead a place on a share line must be for its job's return to
-- be worked out against the tenants due to leave before it (microseconds),
-- and how many of them are counted at most.
local SHARE_SOONEST_FROM_US = 3000000
local SHARE_SOONEST_TENANTS = 32

-- A tenant's share of a route: the route's capacity divides among the
-- tenants with work on it by weight, so each tenant's line on the route is
-- spaced the route's interval × (the weights counted) / its weight. Tenants
-- whose share line is spent leave the sum. A tenant whose own quota holds
-- it below its share counts only for what it can use (`usable`: at most
-- this fraction of the route's sends can be its own), so the rest goes to
-- the others: usable × others / (1 - usable), where `others` is the sum of
-- the others' weights taken as at least one whole weight. Without that
-- floor, tenants that are all held shrink each other's weights to 0.001
-- together, virtual time runs hundreds of times faster than real time, and
-- when a tenant that is not held comes, every share place already given
-- stretches as much (a 1/s tenant went 23 s without a send). Places on a
-- share line are kept in the route's virtual time, which runs at 1 / (the
-- sum) of real time: a place in it stays where it is, among every other
-- tenant's places, however often the sum changes before its job comes
-- back.
--
-- A tenant's own spacing in virtual time (its step: the route's interval /
-- its weight) changes when its weight or the route's quota does. Places
-- already given on its line were spaced at the old step, and kept so they
-- would hold it to its old share: a weight raised from 1 to 5 beside
-- another tenant of weight 1 left a 30/s route sending 10/s until they
-- ran out. So
-- each place goes with the step it was given at, and one given at another
-- step than the tenant's now is re-spaced around the moment the step last
-- changed (as a tenant's own line is around its quota's change).
--
-- `weights_key`: hash 'w:<tenant>' -> weight counted, 's:<tenant>' -> its
-- step and the virtual time it last changed, 'total' -> the weights' sum,
-- 'changed' -> when it last changed, 'v' -> the route's virtual time then;
-- `active_key`: sorted set of the route's tenants with work -> until when.
-- Both in the route's slot. `interval`: the route's spacing (microseconds).
-- Returns the clock {real, virtual, step, place, line, head, soonest}
-- (step: the tenant's spacing in virtual time; place: a place given at a
-- step, re-spaced to today's; line: a line's next free place as kept in its
-- key, in real time; head: that place as the key keeps it; soonest: below),
-- the sum of the weights, when it last changed, and the sum of the others'
-- (as counted).
local function share_clock(weights_key, active_key, tenant_name, weight, usable, interval, now)
  local function field(name) return tonumber(redis.call('HGET', weights_key, name)) end
  local total = field('total') or 0
  local before = total
  if total > 0 and redis.call('EXISTS', active_key) == 0 then
    -- The set of tenants with work expired (its TTL and the weights' are
    -- each only ever raised, and a set emptied and made again starts
    -- shorter): every weight still counted is a tenant that left. Kept,
    -- they held a tenant alone on the route to a fraction of it (1/3 with
    -- two gone) for as long as the route stayed busy.
    local fields = redis.call('HKEYS', weights_key)
    for _, f in ipairs(fields) do
      local kind = string.sub(f, 1, 2)
      if kind == 'w:' or kind == 's:' then redis.call('HDEL', weights_key, f) end
    end
    total = 0
  end
  local done = redis.call('ZRANGEBYSCORE', active_key, '-inf', string.format('%.0f', now), 'LIMIT', 0, 100)
  -- A tenant that leaves keeps its step's record: its jobs parked before
  -- the step last changed may still come back, and their places are
  -- re-spaced around that change. (Dropped with the weight, they were
  -- taken at the step they were given: a route raised from 15/s to 45/s
  -- under two backlogs told the last jobs back to wait for their old
  -- places, 10 s out on an idle route.) The records go when the route's
  -- hash does, or when the set of tenants with work expires (above).
  for _, t in ipairs(done) do
    total = total - (field('w:' .. t) or 0)
    redis.call('HDEL', weights_key, 'w:' .. t)
    redis.call('ZREM', active_key, t)
  end
  local mine = field('w:' .. tenant_name) or 0
  local others = total - mine
  if others < 1e-6 then others = 0 end
  local w = weight
  if w < 1 then w = 1 end
  local whole = w
  if others > 0 and usable < 1 then w = math.min(w, math.max(usable * math.max(others, 1) / (1 - usable), 1e-3)) end
  w = tonumber(string.format('%.6f', w))
  if w ~= mine then redis.call('HSET', weights_key, 'w:' .. tenant_name, string.format('%.6f', w)) end
  total = tonumber(string.format('%.6f', others + w))
  local changed, v = field('changed'), field('v')
  if total ~= before or not changed or not v then
    -- Virtual time runs at 1 / (the sum) while it holds; it starts at the
    -- real time, so a route whose hash expired never moves back.
    if changed and v and before > 0 then v = v + (now - changed) / before else v = now end
    changed = now
    redis.call('HSET', weights_key, 'total', string.format('%.6f', total), 'changed', string.format('%.0f', now),
      'v', string.format('%.3f', v))
  end
  -- An exact division: the shares sum to the route's paced rate. (They
  -- were 1 % wider, which cost the route 1 % of its slots for good and
  -- bought nothing the weights show; ARCHITECTURE, "Weighted shares of a
  -- route".)
  local function real(at) return changed + (at - v) * total end
  local function virtual(at) return v + (at - changed) / total end
  local step = interval / w
  -- Steps travel as whole microseconds: within one, or a ten-thousandth,
  -- they are the same.
  local function same(a, b) return math.abs(a - b) <= math.max(1, b * 1e-4) end
  -- The tenant's step, and the virtual time it last changed (none: it has
  -- not changed while the tenant had work on the route).
  local last = redis.call('HGET', weights_key, 's:' .. tenant_name)
  local last_step, anchor = nil, nil
  if last then
    local s, at = string.match(last, '^(%S+) ?(%S*)$')
    last_step, anchor = tonumber(s), tonumber(at)
  end
  if not last_step or not same(last_step, step) then
    local record = string.format('%.3f', step)
    if last_step then
      anchor = virtual(now)
      record = record .. string.format(' %.3f', anchor)
    end
    redis.call('HSET', weights_key, 's:' .. tenant_name, record)
  end
  -- A place given at step `given` (nil: today's), re-spaced to today's.
  -- Not while the tenant is held below its share by its own quota (counted
  -- for less than its weight): its step then moves with every tenant that
  -- comes or goes, its sends are paced by its own quota and kept on the
  -- route in real time, and re-spacing its places around each move made a
  -- 1/s tenant of twenty lose a slot or two when a fast tenant joined.
  local function place(at, given)
    if not given or not anchor or same(given, step) or at <= anchor or w < whole then return at end
    return anchor + (at - anchor) * step / given
  end
  -- When a place due at `at` (real time, at today's sum) comes if every
  -- other tenant with work leaves the sum once its last place has passed,
  -- and none comes: the soonest its job can be needed. A job parked for
  -- its place comes back then, not at `at`. Judged at today's sum, a
  -- backlog parked in 30 s hops beside a tenant that then finished came
  -- back 16 s after its places had come, the route idle meanwhile. Worked
  -- out only for places further than a hop of a few seconds (closer,
  -- being late costs at most that hop), over the first tenants to leave.
  local function soonest(at)
    if at - now <= SHARE_SOONEST_FROM_US then return at end
    local leaving = redis.call('ZRANGEBYSCORE', active_key, '(' .. string.format('%.0f', now),
      string.format('%.0f', at), 'WITHSCORES', 'LIMIT', 0, SHARE_SOONEST_TENANTS)
    local names, leaves, fields = {}, {}, {}
    for i = 1, #leaving, 2 do
      if leaving[i] ~= tenant_name then
        names[#names + 1], leaves[#leaves + 1] = leaving[i], tonumber(leaving[i + 1])
        fields[#fields + 1] = 'w:' .. leaving[i]
      end
    end
    if #names == 0 then return at end
    local weights = redis.call('HMGET', weights_key, unpack(fields))
    -- In order of leaving: each segment of virtual time passes at the sum
    -- of those still there.
    local at_v, from_v, from, sum = virtual(at), virtual(now), now, total
    for i = 1, #names do
      local left_v, gone = virtual(leaves[i]), tonumber(weights[i]) or 0
      if left_v > from_v and sum - gone >= w - 1e-6 then
        from = from + (left_v - from_v) * sum
        from_v, sum = left_v, sum - gone
      end
    end
    return math.min(at, from + (at_v - from_v) * sum)
  end
  local clock = {
    real = real,
    virtual = virtual,
    step = step,
    place = place,
    line = function(raw)
      if not raw then return nil end
      local at, given = string.match(raw, '^(%S+) ?(%S*)$')
      at = tonumber(at)
      return at and real(place(at, tonumber(given)))
    end,
    head = function(at) return string.format('%.3f %.3f', virtual(at), step) end,
    soonest = soonest,
  }
  return clock, total, changed, others
end

-- Counts the tenant among the route's tenants with work until `until_at`
-- (microseconds); the route's sets live a minute past the furthest.
local function share_count(weights_key, active_key, tenant_name, until_at, now)
  redis.call('ZADD', active_key, string.format('%.0f', until_at), tenant_name)
  local ttl_ms = math.ceil((until_at - now) / 1000) + 60000
  for _, key in ipairs({active_key, weights_key}) do
    if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
  end
end

-- A paused tenant leaves the route's tenants with work now (the next
-- decision takes its weight out of the sum). Counted on, it held the route
-- at half its rate for the others while it was paused.
local function share_leave(active_key, tenant_name, now)
  if redis.call('ZSCORE', active_key, tenant_name) then
    redis.call('ZADD', active_key, string.format('%.0f', now), tenant_name)
  end
end
