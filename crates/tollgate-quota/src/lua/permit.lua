-- Fleet-wide permit decisions for a batch of jobs, one call for all (the
-- jobs a pod asks for while its previous call is in flight). Each, in order:
--   sent?  cancelled?  another copy in flight?  tenant paused?
--   tenant bucket (GCRA)  +  route bucket (GCRA, when configured)  +  tenant concurrency
-- All-or-nothing: a job denied by any part consumes nothing. A permit may be
-- reserved up to `reserve` ahead (at most `horizon`); the worker holds the job
-- until then.
--
-- The keys and arguments of one job's group, by name, bound below in this
-- order. The Rust side names them the same way (`PermitKeys`, `PermitArgs`);
-- a test checks both.
--
-- KEYS[1]  tenant_quota_key           hash: count period_ms burst concurrency paused shadow_count shadow_period_ms shadow_burst
--                                     weight adaptive (and an adaptive quota's parameters, `adapt.lua`)
-- KEYS[2]  tenant_tat_key             GCRA theoretical arrival time, microseconds of Redis time
-- KEYS[3]  tenant_waiting_key         the tenant's line: '<at> <iv> [<room at> <room slots>]', its next free virtual slot,
--                                     their interval, and room made in it for jobs displaced (`make_room`)
-- KEYS[4]  tenant_penalty_key         provider 429: no send before this (microseconds)
-- KEYS[5]  tenant_in_flight_key       zset: lease token -> expiry (microseconds)
-- KEYS[6]  shadow_tat_key             the shadow quota's TAT
-- KEYS[7]  sent_key                   the idempotency key's sent record
-- KEYS[8]  lease_key                  the idempotency key's in-flight lease
-- KEYS[9]  cancelled_id_key           cancellation by job id
-- KEYS[10] cancelled_idempotency_key  cancellation by idempotency key
-- KEYS[11] route_quota_key            hash: count period_ms burst
-- KEYS[12] route_tat_key              the route's TAT
-- KEYS[13] route_share_key            this tenant's line on the route (its share of the route's capacity):
--                                     '<place> <step>', its next free place in the route's virtual time and
--                                     the tenant's step there when it was given
-- KEYS[14] route_penalty_key          provider 429 on a route whose 429s are account-wide
-- KEYS[15] tenant_waiting_high_key    the tenant's line of waiting high-priority jobs (as KEYS[3])
-- KEYS[16] tenant_waiting_low_key     the tenant's line of waiting low-priority jobs (as KEYS[3])
-- KEYS[17] route_active_key           zset: tenant with work on the route -> until when (microseconds)
-- KEYS[18] route_weights_key          hash: 'w:<tenant>' -> weight counted, 'total' -> their sum, 'changed' -> when it last changed,
--                                     'v' -> the route's virtual time then
-- KEYS[19] tenant_adapt_key           what the tenant's adaptive quota learned (`adapt.lua`)
-- KEYS[20] route_adapt_key            what the route's adaptive quota learned
-- KEYS[21] route_kept_key             zset: '<tenant> <place>' -> place (microseconds), the next places of
--                                     tenants held below their shares by their own quotas, kept clear on the route
--
-- ARGV[1]  default_count              the default quota (the stored one, else the config's): count
-- ARGV[2]  default_period_ms          the default quota: period, milliseconds
-- ARGV[3]  default_burst              the default quota: burst
-- ARGV[4]  lease_token                lease token of this attempt
-- ARGV[5]  horizon_us                 reservation horizon, microseconds
-- ARGV[6]  lease_ttl_ms               lease ttl, milliseconds
-- ARGV[7]  pacing_factor              pacing factor (1.02 = sends spaced 2 % wider than the quota)
-- ARGV[8]  pause_recheck_us           recheck interval for a paused tenant, microseconds
-- ARGV[9]  denial_slots               virtual slots handed out per denial (the pod uses the rest locally)
-- ARGV[10] concurrency_retry_us       retry interval when the tenant is at its concurrency limit, microseconds
-- ARGV[11] now_override_us            "now" override in microseconds, for tests only ("" = Redis TIME)
-- ARGV[12] returning_until_us         a job back from a quota wait: when it was told to come back, on this
--                                     clock, microseconds ("" = fresh job)
-- ARGV[13] returning_interval_us      the spacing its place was computed with, microseconds ("" = unknown)
-- ARGV[14] seen_cancel_ttl_ms         how long a seen cancellation is kept for other copies, milliseconds
-- ARGV[15] reserve_us                 how far ahead this job may be reserved (<= horizon), microseconds
-- ARGV[16] priority                   the job's class: high, normal or low
-- ARGV[17] tenant_name                the tenant's name (its member in the route's sets)
-- ARGV[18] returning_share_place      a job back for a place on its share of the route: that place in the
--                                     route's virtual time ("" = none)
-- ARGV[19] default_changed_ms         when the stored default quota last changed, milliseconds ("" = the
--                                     config's): the pod reads it (at most a second old), so this
--                                     script touches no key outside the tenant's and the route's slots
-- ARGV[20] route_at                   the send time the route's slot reserved for this job (microseconds,
--                                     `route.lua`) when the route's keys live in another slot: granted
--                                     at exactly that time if the tenant's pace allows a send then, else
--                                     denied ("" = no such reservation; the route keys above decide)
-- ARGV[21] returning_share_step       the step (virtual) that place was given at ("" = unknown: today's)
--
-- Reply: one {code, a, b, c} per group, in order:
--   {0, delay, shadow, send, leeway, late, weight}
--                               granted at now + delay = send (microseconds since the epoch, Redis
--                               time); shadow 0 none, 1 would allow, 2 would deny; leeway: how late
--                               after `send` the call may still begin (microseconds, below); late:
--                               how far `send` is past `route_at` already (microseconds); the
--                               tenant's weight (thousandths)
--   {1, retry_in, interval, n, kept, share_place, share_interval, made}
--                               denied: n virtual slots from now + retry_in, `interval` apart;
--                               kept = 1 when a returning job keeps (a re-spaced) place; for places
--                               on the tenant's share of a route, the first in the route's virtual
--                               time and their spacing there (0 and 0: none); made: `now`
--                               (microseconds since the epoch, Redis time), which retry_in counts from
--   {2}                         duplicate: already sent
--   {3, retry_in}               another copy holds the lease
--   {4, retry_in}               tenant paused
--   {5}                         cancelled
--   {6, retry_in}               tenant at its concurrency limit

-- One decision; KEYS and ARGV here are the job's group of the call's.
local function permit(KEYS, ARGV)
  local tenant_quota_key = KEYS[1]
  local tenant_tat_key = KEYS[2]
  local tenant_waiting_key = KEYS[3]
  local tenant_penalty_key = KEYS[4]
  local tenant_in_flight_key = KEYS[5]
  local shadow_tat_key = KEYS[6]
  local sent_key = KEYS[7]
  local lease_key = KEYS[8]
  local cancelled_id_key = KEYS[9]
  local cancelled_idempotency_key = KEYS[10]
  local route_quota_key = KEYS[11]
  local route_tat_key = KEYS[12]
  local route_share_key = KEYS[13]
  local route_penalty_key = KEYS[14]
  local tenant_waiting_high_key = KEYS[15]
  local tenant_waiting_low_key = KEYS[16]
  local route_active_key = KEYS[17]
  local route_weights_key = KEYS[18]
  local tenant_adapt_key = KEYS[19]
  local route_adapt_key = KEYS[20]
  local route_kept_key = KEYS[21]
  local default_count = ARGV[1]
  local default_period_ms = ARGV[2]
  local default_burst = ARGV[3]
  local lease_token = ARGV[4]
  local horizon_us = ARGV[5]
  local lease_ttl_ms = ARGV[6]
  local pacing_factor = ARGV[7]
  local pause_recheck_us = ARGV[8]
  local denial_slots = ARGV[9]
  local concurrency_retry_us = ARGV[10]
  local now_override_us = ARGV[11]
  local returning_until_us = ARGV[12]
  local returning_interval_us = ARGV[13]
  local seen_cancel_ttl_ms = ARGV[14]
  local reserve_us = ARGV[15]
  local priority = ARGV[16]
  local tenant_name = ARGV[17]
  local returning_share_place = ARGV[18]
  local default_changed_ms = ARGV[19]
  local route_at = ARGV[20]
  local returning_share_step = ARGV[21]

  local now = now_us(now_override_us)
  local horizon = tonumber(horizon_us)
  -- The pod narrows it for a job it would not hold that long.
  local reserve = math.min(tonumber(reserve_us) or horizon, horizon)
  -- How long before its place on its tenant's line a denied job comes back
  -- (to be reserved then). A place on a share line is a send time of the
  -- route's own: such a job comes back the whole window before it.
  local come_back, share_come_back = reserve, reserve
  local pacing = tonumber(pacing_factor)

  -- The common case, nothing sent and nothing cancelled, in one call.
  if redis.call('EXISTS', sent_key, cancelled_id_key, cancelled_idempotency_key) > 0 then
    if redis.call('EXISTS', sent_key) == 1 then return {2} end
    -- A cancellation waits (up to cancel_ttl) for its job; once the job is
    -- seen it is kept as long as a sent record, so other copies are skipped
    -- too.
    for _, key in ipairs({cancelled_id_key, cancelled_idempotency_key}) do
      local ttl = redis.call('PTTL', key)
      if ttl ~= -2 and (ttl < 0 or ttl > tonumber(seen_cancel_ttl_ms)) then
        redis.call('PEXPIRE', key, seen_cancel_ttl_ms)
      end
    end
    return {5}
  end

  -- Every value a decision may read but the quotas, in one call: the
  -- lease, the penalties, the buckets' TATs, the lines (each a string, so
  -- that one MGET reads them all).
  local held = redis.call('MGET', lease_key, tenant_penalty_key, route_penalty_key, tenant_tat_key, route_tat_key,
    tenant_waiting_high_key, tenant_waiting_key, tenant_waiting_low_key, route_share_key)
  local holder, lease_marks = lease_parts(held[1])
  -- Another copy's call, or this job's own that timed out unanswered ('x',
  -- `complete.lua`): wait for its lease to expire.
  if holder and (holder ~= lease_token or string.find(lease_marks or '', 'x', 1, true)) then
    local ttl = redis.call('PTTL', lease_key)
    if ttl < 1 then ttl = 1 end
    return {3, ttl * 1000}
  end

  local q = redis.call('HMGET', tenant_quota_key, 'count', 'period_ms', 'burst', 'concurrency', 'paused',
    'shadow_count', 'shadow_period_ms', 'shadow_burst', 'updated_at_ms', 'weight', 'adaptive')
  if q[5] == '1' then
    -- Paused: its jobs park without their places, and it leaves the route
    -- (`share_leave`) with its share line. Kept, the line held its jobs
    -- after the resume, back as new, behind its stale places: 2 sends in
    -- 30 s with 540 waiting.
    share_leave(route_active_key, tenant_name, now)
    redis.call('DEL', route_share_key)
    return {4, tonumber(pause_recheck_us)}
  end

  -- A bucket (`buckets.lua`) of this decision's pacing and clock.
  local function bucket(count, period_ms, burst, changed_ms)
    return quota_bucket(count, period_ms, burst, changed_ms, pacing, now)
  end

  -- An adaptive quota is spaced at the rate learned (its own is the ceiling).
  local tenant = adapt_bucket(bucket(q[1], q[2], q[3], q[9]), q[11], tenant_quota_key, tenant_adapt_key, pacing)
  if not tenant then tenant = bucket(default_count, default_period_ms, default_burst, default_changed_ms) end
  local r = redis.call('HMGET', route_quota_key, 'count', 'period_ms', 'burst', 'updated_at_ms', 'adaptive')
  local route = adapt_bucket(bucket(r[1], r[2], r[3], r[4]), r[5], route_quota_key, route_adapt_key, pacing)

  -- A place in line given at spacing `old`, re-spaced to the bucket's current
  -- spacing around the moment the quota changed.
  local function respace(place, old, b)
    if not old or old <= 0 or math.abs(old - b[1]) <= 0.5 or place <= b[3] then return place end
    return b[3] + (place - b[3]) * b[1] / old
  end

  local function load_tat(raw, b) return clamped_tat(raw, b, now, horizon) end

  -- A provider 429 (Retry-After) on the tenant, or on the whole route when its
  -- 429s are account-wide: no send before this instant, whatever the burst.
  local penalty = math.max(tonumber(held[2]) or 0, tonumber(held[3]) or 0)

  -- Microseconds until the bucket (and the penalty) allow a send.
  local function delay_of(tat, b)
    local d = math.max(tat - b[1] * (b[2] - 1), penalty) - now
    if d < 0 then return 0 end
    return d
  end

  -- The next free place of a line (re-spaced if the quota changed), or nil.
  -- A share of a route (a bucket with a clock, b[4]) keeps its line in the
  -- route's virtual time. Each line is read once per decision (`held`).
  -- A tenant's line may also keep room made in it (`make_room`): '<at> <iv>
  -- <room at> <room slots>'.
  local line_read = {[tenant_waiting_high_key] = held[6], [tenant_waiting_key] = held[7],
    [tenant_waiting_low_key] = held[8], [route_share_key] = held[9]}
  local line_cache, rooms = {}, {}
  local function line_at(waiting_key, b)
    local cached = line_cache[waiting_key]
    if cached ~= nil then return cached or nil end
    local read, at = line_read[waiting_key], nil
    if read and b[4] then
      at = b[4].line(read)
    elseif read then
      local place, iv, room_at, room_n = string.match(read, '^(%S+) (%S+) ?(%S*) ?(%S*)$')
      at = tonumber(place)
      if at then at = respace(at, tonumber(iv), b) end
      room_at, room_n = tonumber(room_at), tonumber(room_n)
      if room_at and room_n and room_n > 0 then
        rooms[waiting_key] = {at = respace(room_at, tonumber(iv), b), n = room_n}
      end
    end
    line_cache[waiting_key] = at or false
    return at
  end

  -- Moves a line's next free place to `next_at` (keeping its room).
  local function push_line(waiting_key, next_at, b)
    local ttl = math.max(math.ceil((next_at - now) / 1000) + 1000, 1)
    if b[4] then
      redis.call('SET', waiting_key, b[4].head(next_at), 'PX', ttl)
    else
      local value = string.format('%.0f %.3f', next_at, b[1])
      local room = rooms[waiting_key]
      if room and room.n > 0 then value = value .. string.format(' %.0f %d', room.at, room.n) end
      redis.call('SET', waiting_key, value, 'PX', ttl)
    end
    line_cache[waiting_key] = next_at
  end

  -- n slots at `at` went to a class served before the lines after `own`: those
  -- with places from there on move back by as many slots, and the slots
  -- that frees at their end are kept as the line's room for the jobs
  -- displaced (`from_room`). Those jobs, finding their slot taken when they
  -- come back, went to the back of their line, behind the room made for
  -- them, which nobody took: 200 low jobs, then 20 normal and 20 high,
  -- left the tenant without a send for 6 s.
  local function make_room(keys, own, at, b, n)
    for i = own + 1, #keys do
      local line = line_at(keys[i], b)
      if line and line > at then
        local room = rooms[keys[i]]
        if room and room.n > 0 then
          room.n = room.n + n
        else
          rooms[keys[i]] = {at = line, n = n}
        end
        push_line(keys[i], line + b[1] * n, b)
      end
    end
  end

  -- A place in the room made in line `keys[own]` for a job back for its
  -- place and finding it taken, if there is room: the room's first slot,
  -- after the places of the lines served before it, after tat and the
  -- penalty. Returns the denial's retry, or nil.
  local function from_room(keys, own, tat, b)
    local room = rooms[keys[own]]
    local head = line_at(keys[own], b)
    if not (room and room.n > 0 and head) then return nil end
    local at = math.max(room.at, tat, penalty + b[1] * (b[2] - 1))
    for i = 1, own - 1 do
      local line = line_at(keys[i], b)
      if line and line > at then at = line end
    end
    if at >= head then
      rooms[keys[own]] = nil
      push_line(keys[own], head, b)
      return nil
    end
    room.at, room.n = at + b[1], room.n - 1
    push_line(keys[own], head, b)
    return math.max(at - b[1] * (b[2] - 1) - now - come_back, 0)
  end

  -- Virtual slots for a denied job: n slots in its line (`keys[own]`), one
  -- interval apart, after the places of the lines served before it and its
  -- own, after tat, and not before the penalty ends.
  local function waiting_slots(keys, own, tat, b, n)
    local at = tat
    for i = 1, own do
      local line = line_at(keys[i], b)
      if line and line > at then at = line end
    end
    local floor = penalty + b[1] * (b[2] - 1)
    if at < floor then at = floor end
    push_line(keys[own], at + b[1] * n, b)
    make_room(keys, own, at, b, n)
    local due = at
    if b[4] then due = b[4].soonest(at) end
    local retry = due - b[1] * (b[2] - 1) - now - (b[4] and share_come_back or come_back)
    if retry < 0 then retry = 0 end
    return retry, at
  end

  -- This tenant's share of the route (`shares.lua`), as a bucket of burst 1
  -- (places are send times) whose places are kept in the route's virtual
  -- time: {spacing, 1, changed, clock}.
  local function route_share()
    local w = tonumber(q[10]) or 1
    local clock, total, changed, others = share_clock(route_weights_key, route_active_key, tenant_name, w,
      route[1] / tenant[1], route[1], now)
    -- Held below its share by its own quota: its spacing is wider than
    -- its whole weight's share would be (with the others at their whole
    -- weights too, at least 1 each; the counted weights of tenants held
    -- below theirs would overstate its share), by more than 1 %. Alone on
    -- the route, its share is the route: it is held below it as soon as
    -- it is slower, so its places are kept before another tenant comes.
    -- Only asked where places are kept (a route of burst 1, below).
    local held_below = false
    if route[2] == 1 and tenant[2] == 1 then
      local count = redis.call('ZCARD', route_active_key)
      if redis.call('ZSCORE', route_active_key, tenant_name) then count = count - 1 end
      local raw = math.max(w, 1)
      held_below = tenant[1] > 1.01 * route[1] * (math.max(others, count) + raw) / raw
    end
    return {math.ceil(clock.step * total), 1, changed, clock, others}, held_below
  end

  local tenant_tat, tenant_stored = load_tat(held[4], tenant)
  local delay = delay_of(tenant_tat, tenant)
  -- The route's slot reserved this send time: the tenant takes exactly it,
  -- or refuses (and the pod gives it back to the route).
  local pinned = tonumber(route_at)
  if pinned then pinned = math.max(pinned - now, 0) end
  local route_tat, route_delay, share, route_idle = 0, 0, nil, false
  -- Whether this tenant is held below its share by its own quota.
  local held_below = false
  if route then
    local stored
    route_tat, stored = load_tat(held[5], route)
    route_delay = delay_of(route_tat, route)
    share, held_below = route_share()
    -- A slot of the route went unused for a whole interval: whoever asks may
    -- take the next one, whatever its share says. Shares order a contended
    -- route; they never leave it idle.
    route_idle = route_delay == 0 and delay == 0 and (stored or 0) + route[1] <= now
    -- The route's bucket has one "next free" time, so a send reserved past
    -- it leaves the slots before it to nobody: a tenant paced by its own
    -- quota, reserving its next slot 400 ms ahead, held every other
    -- tenant's sends back as long. The route is reserved no further than
    -- one of its slots (at least ROUTE_LEAD_US) past its own next slot; a
    -- job whose tenant's slot is further is given its place and comes back
    -- that lead before it (not the window, which moves with the route).
    local lead = math.max(route[1], ROUTE_LEAD_US)
    reserve = math.min(reserve, route_delay + lead)
    come_back = math.min(come_back, lead)
  end

  -- Kept places. A tenant held below its share of a busy route by its own
  -- quota sends in one of every few of the route's slots, at its own
  -- spacing. The others' reservations run ahead of it (up to the window),
  -- so each of its sends found the route taken past its place and went out
  -- a slot later; a bucket of burst 1 cannot make that up, so it lost a
  -- slot's wait on every send (0.78-0.87 of its quota beside a tenant that
  -- could take the route). Such a tenant's next places within the others'
  -- reach are kept on the route (`route_kept_key`, member '<tenant> <place>'
  -- by place): the others' reservations keep an interval clear of them, and
  -- its jobs take them, even behind the route's next free time. Only on a
  -- route of burst 1, whose sends are spaced one interval.
  local kept_on = route and share and route[2] == 1
  -- A kept place stays kept for half a grant's leeway after it passes: a
  -- job held in its pod for its place asks again when the place comes, so
  -- it reaches the script a timer and a round trip after it (0.1-3.3 ms,
  -- traced). Dropped the moment it passed, the place was gone when its
  -- job came, the job took the tenant's next place (the next job's), and
  -- that job went to the back of the line: at one delivery per queue the
  -- tenant sent 0.59-0.95 of its quota in a quarter of the runs. A send that
  -- late counts as a send on its place whose call began late
  -- (`bucket_leeway`): it is given only the rest of the leeway, at least
  -- half of it, so that the pod still has time to begin the call (a
  -- permit read too late is let go, and its place is spent).
  -- How late a granted call may begin (`bucket_leeway`).
  local grant_leeway = bucket_leeway(tenant, pacing)
  if route then grant_leeway = math.min(grant_leeway, bucket_leeway(route, pacing)) end
  local kept_grace = 0
  if kept_on then
    kept_grace = grant_leeway / 2
    redis.call('ZREMRANGEBYSCORE', route_kept_key, '-inf', '(' .. string.format('%.0f', now - kept_grace))
  end

  -- Kept places from `lo` to `hi` (nil: on; exclusive when `open`):
  -- {tenant, place, member}.
  local function kept_between(lo, hi, open)
    local l, h = string.format('%.0f', lo), hi and string.format('%.0f', hi) or '+inf'
    if open then l, h = '(' .. l, '(' .. h end
    local raw = redis.call('ZRANGEBYSCORE', route_kept_key, l, h, 'WITHSCORES')
    local places = {}
    for i = 1, #raw, 2 do
      places[#places + 1] = {tenant = string.match(raw[i], '^(%S+) '), place = tonumber(raw[i + 1]), member = raw[i]}
    end
    return places
  end

  -- Another tenant's kept place closer than an interval to `at`, if any
  -- (not one of `skip`).
  local function kept_near(at, skip)
    for _, p in ipairs(kept_between(at - route[1], at + route[1], true)) do
      if p.tenant ~= tenant_name and not (skip and skip[p.member]) then return p end
    end
    return nil
  end

  -- The first time from `at` on that keeps an interval clear of the others'
  -- kept places. A place less than half an interval after `at` is stepped
  -- over (the route idles until it); one further on moves later instead, to
  -- an interval after `at`, with its tenant's later places (its send is that
  -- much later): whichever costs less. (Spacings round up to whole
  -- microseconds, so a tenant's places three of the route's intervals apart
  -- fall a microsecond short of three intervals; always stepping over them
  -- cost the route one slot in three.) What moves is kept so on a grant
  -- (`keep_moved`). Still not clear after `ROUTE_KEPT_STEPS` steps (the
  -- places of many tenants close together): no time at all, so the job is
  -- refused rather than sent close to a kept place.
  local moved = {}
  local function clear_of_kept(at)
    if not kept_on then return at end
    local skip = {}
    for _ = 1, ROUTE_KEPT_STEPS do
      local p = kept_near(at, skip)
      if not p then return at end
      if p.place - at > route[1] / 2 then
        local by = at + route[1] - p.place
        for _, q in ipairs(kept_between(p.place, nil, false)) do
          if q.tenant == p.tenant and not skip[q.member] then
            skip[q.member] = true
            moved[#moved + 1] = {q.member, q.place + by, q.tenant}
          end
        end
      else
        at = p.place + route[1]
      end
    end
    if kept_near(at, skip) then return math.huge end
    return at
  end
  -- Keeps `at` for `name`.
  local function keep(name, at)
    local t = string.format('%.0f', at)
    redis.call('ZADD', route_kept_key, t, name .. ' ' .. t)
  end
  local function keep_moved()
    for _, m in ipairs(moved) do
      redis.call('ZREM', route_kept_key, m[1])
      keep(m[3], m[2])
    end
  end

  -- The route's send time for a job its tenant allows from `from`: at its
  -- tenant's kept place within one of the tenant's spacings of `from` and
  -- before the route's next free time, or at `from` for one passed less
  -- than `kept_grace` before it (the place as third value), or else the
  -- first time from the later of `from` and the route's next free time
  -- that keeps clear of the others' kept places.
  local function route_slot(from)
    local free = now + route_delay
    if kept_on and from < free then
      for _, p in ipairs(kept_between(from - kept_grace, math.min(free, from + tenant[1]), false)) do
        if p.tenant == tenant_name and p.place < free and not kept_near(p.place) then
          return math.ceil(math.max(p.place, from)), p.place
        end
      end
    end
    return math.ceil(clear_of_kept(math.max(from, free))), nil
  end

  -- While its quota holds it below its share, the tenant's next places
  -- within the others' reach (the horizon, a spacing on) are kept, up to
  -- its line's last: on from its last place kept after `after`, else from
  -- `first` (its bucket's next slot), and from the route's next free time
  -- (a reservation before it may sit close to one). Kept on a denial too,
  -- so that a tenant's first places on a busy route are kept before the
  -- others' reservations reach them, not only from its second send on.
  local function keep_places(first, after)
    if not (kept_on and held_below) then return end
    local at = first
    for _, p in ipairs(kept_between(after, nil, true)) do
      if p.tenant == tenant_name then at = p.place + tenant[1] end
    end
    local till = math.min(math.max(at, line_at(tenant_waiting_key, tenant) or 0), now + horizon + tenant[1])
    at = math.max(at, route_tat)
    while at <= till and not kept_near(at) do
      keep(tenant_name, at)
      at = at + tenant[1]
    end
    local ttl = math.ceil((till - now) / 1000) + 1000
    if redis.call('PTTL', route_kept_key) < ttl then redis.call('PEXPIRE', route_kept_key, ttl) end
  end

  -- The tenant counts among the route's tenants with work while it holds
  -- places on either of its lines there, and for one share spacing after any
  -- decision.
  local function count_on_route()
    if not share then return end
    local until_at = now + share[1]
    for _, at in ipairs({line_at(route_share_key, share) or 0, line_at(tenant_waiting_key, tenant) or 0}) do
      if at > until_at then until_at = at end
    end
    share_count(route_weights_key, route_active_key, tenant_name, until_at, now)
  end

  -- The decision itself, once the route's shares are known; every outcome
  -- counts the tenant among the route's tenants with work (below).
  local function decide()
    -- The tenant's lines, in the order they are served: high, normal, low.
    local lines = {tenant_waiting_high_key, tenant_waiting_key, tenant_waiting_low_key}
    local rank = ({high = 1, normal = 2, low = 3})[priority] or 2
    -- A job back from a quota wait brings when it was told to come back; what
    -- is left of that wait is counted here, on this clock. Counted by the
    -- pod, it lost the request's way here on every hop, and a backlog's
    -- later jobs, after several hops, came back tens of ms past their places
    -- (the places the route kept for them had gone).
    local remaining = tonumber(returning_until_us)
    if remaining then remaining = math.max(remaining - now, 0) end

    -- Places already handed out beyond a bucket's TAT are jobs parked for them.
    -- A fresh job waits behind the places of its own class and of the classes
    -- served before it; a job back for its place, behind those of the classes
    -- served before it only. Returns the furthest such place, if beyond tat.
    local function line_ahead(keys, last, tat, b)
      local furthest = nil
      for i = 1, last do
        local at = line_at(keys[i], b)
        if at and at > tat and (not furthest or at > furthest) then furthest = at end
      end
      return furthest
    end
    local tenant_line = line_ahead(lines, remaining and rank - 1 or rank, tenant_tat, tenant)
    -- A fresh job takes the tenant's share of the route in turn: it waits while
    -- the next place of the tenant's share is beyond its window.
    local share_ahead = nil
    if share and not remaining and not route_idle then
      local at = line_at(route_share_key, share)
      if at and at > now + reserve then share_ahead = at end
    end
    -- A job back early (a hop) for a place on its share line waits for it,
    -- wherever the shares have moved it, even when the route's bucket is free
    -- or idle: the route's next slots may be other tenants' places, and a slot
    -- left idle should go to a job that is behind its place, not ahead of it.
    local share_place = share and remaining and tonumber(returning_share_place)
    -- Alone on an idle route, a place on its share line orders nobody: the
    -- job goes now. (A route raised live under two backlogs sent one job,
    -- parked before the raise in a long tier, 11-17 s after all the others,
    -- its place still far out on an idle route.)
    if share_place and route_idle and share[5] == 0 then share_place = nil end
    if share_place then share_place = share[4].place(share_place, tonumber(returning_share_step)) end
    -- A denial with places on the share line: the first, `v` in the route's
    -- virtual time, and their spacing there go with it (the job brings its
    -- place back).
    local function on_share(reply, v)
      reply[6] = math.floor(v)
      reply[7] = math.floor(share[4].step)
      return reply
    end
    if share_place then
      -- Never beyond the line's next free place: every place handed out lies
      -- before it, whatever the weights did since.
      local place = share[4].real(share_place)
      local head = line_at(route_share_key, share)
      if head and place > head then place, share_place = head, share[4].virtual(head) end
      if place - now > 2 * share_come_back then
        local due = share[4].soonest(place)
        return on_share({1, math.ceil(due - share_come_back - now), math.floor(share[1]), 1, 1}, share_place)
      end
    end

    -- When the route would send this job, and the place it keeps for the
    -- tenant that the send is on, if any.
    local route_send, kept_at = now + delay, nil
    if route then route_send, kept_at = route_slot(now + delay) end

    local n = tonumber(denial_slots)
    -- A job back from a hop more than one spacing before its place (or, on
    -- a cluster, where the route's call already chose its time, beyond the
    -- horizon) keeps its place, even when the bucket has a slot free now
    -- (within the horizon it is held for it in the pod): that slot is the
    -- place of a job about to come back for it (a few ms late, say), which
    -- would find it taken and go to the back of its line, and the place
    -- left behind passes with nobody to take it. Runs of such places, left
    -- by a herd of hops, were most of the slots a backlog missed. A job
    -- still takes a free slot as before when it is back for its place
    -- (after a lowered rate re-spaced the places, those slots are the only
    -- ones anyone takes), when its place was given at another spacing than
    -- the quota's now (after a raise, that is how a parked backlog picks up
    -- the new rate within a hop), and for an adaptive quota, whose spacing
    -- moves with every probe: its places are re-spaced around the last move
    -- only, and the free slots that leaves are filled by whoever asks
    -- (measured: a backlog at 0.82 of the provider's limit when they were
    -- not, 0.92 when they were). A place given at today's spacing is kept
    -- however recently the quota changed: a quota set just before its
    -- backlog arrived used to leave every place free for 10 s to whoever
    -- came back first, and the jobs back late for theirs left gaps.
    -- When the rule held beyond the horizon only, a job back a few hundred
    -- ms early took the slot of the one due before it, which went to the
    -- back of the line: on a busy shared route the tenant went 2.5 s without
    -- a send (gcra.rs, a tenant held by its own quota keeps its pace). On a
    -- cluster the wider rule cost the route's drain 0.6 s and gained nothing.
    local carried = tonumber(returning_interval_us)
    local early = pinned and horizon or math.min(horizon, tenant[1])
    local far = remaining and remaining > early and not tonumber(returning_share_place)
      and q[11] ~= '1' and carried and math.abs(carried - tenant[1]) <= 0.5
    if far or delay > reserve or route_send - now > reserve or tenant_line or share_ahead
      or (pinned and delay > pinned) then
      -- Queue on whichever side is further out: the tenant's own lines, or its
      -- share line on the route (places there are send times, from when the
      -- route's bucket allows one). Only that side's line moves.
      local b, b_tat, b_lines, b_rank, b_ahead = tenant, tenant_tat, lines, rank, tenant_line
      local tenant_far = math.max(delay, (tenant_line or now) - now)
      -- A job back from a hop before its place on the tenant's line is that
      -- far out too, whatever the route's bucket says now. Judged by the
      -- buckets alone, a busy route sent every such job to the share line,
      -- all to the route's same next moment: one got it, the rest went to
      -- the back of the tenant's line, seconds out.
      if remaining and not tonumber(returning_share_place) then
        tenant_far = math.max(tenant_far, remaining)
      end
      if share and math.max(route_delay, (share_ahead or now) - now) > tenant_far then
        b, b_tat, b_lines, b_rank, b_ahead = share, now + route_delay, {route_share_key}, 1, nil
      end
      if remaining then
        -- Back from (a hop of) its wait: keep the place, re-spaced like the line
        -- if the quota changed since it was given. (`place` is when to come
        -- back: `come_back` before the slot itself; it waits while that slot
        -- is beyond its window.) A place on the share line has come (above).
        if b ~= share then
          -- The spacing a place on the share line came with is the share's:
          -- it says nothing of the tenant's line, so such a place is taken
          -- as it is. And never beyond its line's next free place.
          local carried = not tonumber(returning_share_place) and tonumber(returning_interval_us) or nil
          local place = respace(now + remaining, carried, b)
          local head = line_at(lines[rank], tenant)
          if head and place > head then place = head end
          if place + come_back - now > reserve or (far and place > now) then
            return {1, math.ceil(place - now), math.floor(b[1]), 1, 1}
          end
        end
        if b_ahead then
          -- Its place has come, but places of a class served first are still
          -- out: it goes right after them, ahead of its own class's line.
          local place = math.max(b_ahead - b[1] * (b[2] - 1), penalty) - come_back
          -- Their jobs have not come for them yet: look again a slot later,
          -- never at once (their places pass with time).
          if place <= now then place = now + b[1] end
          return {1, math.ceil(place - now), math.floor(b[1]), 1, 1}
        end
        if b == share and share_place then
          -- Its share's place has come and the route is busy past the window
          -- (other tenants' places fell close together): it keeps its turn and
          -- asks again as the route frees.
          local retry = math.ceil(math.max(route_delay - reserve, route[1]))
          local reply = {1, retry, math.floor(b[1]), 1, 1}
          return on_share(reply, share_place)
        end
        -- A job back for a place on its tenant's line that the route is
        -- reserved past takes a place on the share line like any other job
        -- (below), its own. Handed the route's next free time instead, two
        -- such jobs asking together got the same place: one took it, the
        -- other went to the back of the line, and the tenant lost a slot.

        -- Its slot went to another job (it came back late, or a reservation
        -- took it): the back of its line. Moving it to the front instead would
        -- shift every place behind it by as much, each costing a round trip
        -- (measured: 200 tenants × 20 jobs drained in 27 s instead of 13 s).
      end
      -- Back for its place and finding it taken (a class served first took
      -- it, or the job came late): the room made in its line, if any.
      local roomed = remaining and b ~= share and from_room(b_lines, b_rank, b_tat, b)
      if roomed then return {1, math.ceil(roomed), math.floor(b[1]), 1, 0} end
      local retry, at = waiting_slots(b_lines, b_rank, b_tat, b, n)
      local reply = {1, math.ceil(retry), math.floor(b[1]), n, 0}
      if b == share then return on_share(reply, share[4].virtual(at)) end
      keep_places(math.ceil(tenant_tat), now)
      return reply
    end

    local concurrency = tonumber(q[4])
    if concurrency and concurrency > 0 then
      redis.call('ZREMRANGEBYSCORE', tenant_in_flight_key, '-inf', now)
      if redis.call('ZCARD', tenant_in_flight_key) >= concurrency then
        return {6, tonumber(concurrency_retry_us)}
      end
    end

    -- Granted: the send happens at `send`; each bucket's next slot counts from it.
    delay = route_send - now
    if pinned then delay = pinned end
    delay = math.ceil(delay)
    local send = now + delay
    -- Times are rounded up to whole microseconds: a send is never early.
    -- A send on a kept place it is late for counts from that place (its
    -- call begins as much later, below), so the lateness does not carry
    -- to the tenant's next places.
    local function advance(tat_key, tat, b, from)
      local next_tat = math.ceil(math.max(tat, from) + b[1])
      redis.call('SET', tat_key, string.format('%d', next_tat), 'PX', math.ceil((next_tat - now) / 1000) + 1000)
      return next_tat
    end
    local kept_late = kept_at and send - kept_at or 0
    local tenant_next = advance(tenant_tat_key, kept_late > 0 and (tenant_stored or kept_at) or tenant_tat,
      tenant, send - kept_late)
    -- A fresh job took a slot ahead of the places of the classes served after it.
    if not remaining then make_room(lines, rank, tenant_tat, tenant, 1) end
    -- A kept place lies behind the route's next free time, clear of the
    -- sends around it.
    if route and not kept_at then route_tat = advance(route_tat_key, route_tat, route, send) end
    if kept_on then
      keep_moved()
      -- The tenant's places up to this send are spent; sent off its places
      -- (late for one), the rest are spaced from a time gone by.
      for _, p in ipairs(kept_between(now - kept_grace, (kept_at and held_below) and send or nil, false)) do
        if p.tenant == tenant_name then redis.call('ZREM', route_kept_key, p.member) end
      end
      keep_places(tenant_next, send)
    end
    if route then
      -- The send used a place of the tenant's share: the next is a spacing on.
      -- A fresh job may go out before the tenant's next place (the route had
      -- a slot free within its window): it uses that place, so a tenant
      -- whose jobs ask often cannot take free slots beyond its share. A job
      -- back for a share place finds the line already past it.
      local at = line_at(route_share_key, share)
      if not remaining then
        push_line(route_share_key, math.max(at or now, now) + share[1], share)
      elseif not at or at < now + share[1] then
        push_line(route_share_key, now + share[1], share)
      end
    end

    -- The lease lasts past the latest moment the call may begin (its slot,
    -- plus the leeway: 36 s for a per-hour quota at the default margin) by
    -- the provider timeout and more. Without the leeway, a call begun late
    -- but within it could outlive its lease, and a copy with the same key
    -- (or another job past the concurrency limit) was granted meanwhile.
    local lease_ms = tonumber(lease_ttl_ms) + math.ceil(delay / 1000)
      + math.ceil(math.max(grant_leeway, 0) / 1000)
    local marks = ''
    if concurrency and concurrency > 0 then marks = 'c' end
    if q[11] == '1' then marks = marks .. 't' end
    if r[5] == '1' then marks = marks .. 'r' end
    redis.call('SET', lease_key, lease_token .. '/' .. marks, 'PX', lease_ms)
    if concurrency and concurrency > 0 then
      redis.call('ZADD', tenant_in_flight_key, string.format('%.0f', now + lease_ms * 1000), lease_token)
      redis.call('PEXPIRE', tenant_in_flight_key, lease_ms + 1000)
    end

    -- Shadow quota: would it have allowed this send? Computed, never enforced.
    local verdict = 0
    local shadow = bucket(q[6], q[7], q[8])
    if shadow then
      local stat = tonumber(redis.call('GET', shadow_tat_key)) or send
      if stat < send then stat = send end
      local scap = send + shadow[1] * shadow[2]
      if stat > scap then stat = scap end
      if stat - shadow[1] * (shadow[2] - 1) <= send then verdict = 1 else verdict = 2 end
      -- Only a send it would allow moves it, as a grant moves the real one:
      -- moved by the sends it would deny too, it stayed at its cap and
      -- judged every later send "deny" (1 of 100 allowed at 10/s against 5/s).
      if verdict == 1 then
        local snext = math.max(stat, send) + shadow[1]
        redis.call('SET', shadow_tat_key, string.format('%.0f', snext), 'PX', math.ceil((snext - now) / 1000) + 1000)
      end
    end

    -- How late the call may begin: less how late it is for a kept place.
    local leeway = grant_leeway - kept_late
    -- This slot's clock read past the time the route's slot reserved (a
    -- round trip later): the send is that late already.
    local late = 0
    if pinned then late = math.max(now - tonumber(route_at), 0) end
    -- Weights go as thousandths (a reply carries integers).
    local weight = math.floor((tonumber(q[10]) or 1) * 1000 + 0.5)
    return {0, delay, verdict, send, math.floor(leeway), math.ceil(late), weight}
  end

  local reply = decide()
  count_on_route()
  if reply[1] == 1 then
    -- A denial's retry counts from when it was made: counted from when the
    -- pod read it, a job held for its place asked as much later as the reply
    -- had waited (in Redis's socket, the batch, the pod's runtime), and found
    -- a kept place gone that it was on time for.
    reply[6], reply[7], reply[8] = reply[6] or 0, reply[7] or 0, math.floor(now)
  end
  return reply
end
