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
-- `weights_key`: hash 'w:<tenant>' -> weight counted, 'total' -> their sum,
-- 'changed' -> when it last changed, 'v' -> the route's virtual time then;
-- `active_key`: sorted set of the route's tenants with work -> until when.
-- Both in the route's slot. `interval`: the route's spacing (microseconds).
-- Returns the clock {real, virtual, step} (step: the tenant's spacing in
-- virtual time), the sum of the weights, when it last changed, and the sum
-- of the others' (as counted).
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
      if string.sub(f, 1, 2) == 'w:' then redis.call('HDEL', weights_key, f) end
    end
    total = 0
  end
  local done = redis.call('ZRANGEBYSCORE', active_key, '-inf', string.format('%.0f', now), 'LIMIT', 0, 100)
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
  local clock = {
    real = function(at) return changed + (at - v) * total end,
    virtual = function(at) return v + (at - changed) / total end,
    step = interval / w,
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
