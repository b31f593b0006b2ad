-- Adds a pod's tally of tenants' provider calls to each tenant's stats
-- (for the console): the pod counts each call as it completes and adds its
-- tally every half second, so a job's completion writes only what a
-- guarantee needs. The counts land in the buckets of the moment they are
-- added (Redis time), at most half a second after their calls.
--
-- KEYS[i]  tenant i's stats hash
-- ARGV, for each tenant in turn: calls sent, answered 429, failed
-- otherwise; then first attempts by how late they went out after they were
-- due: n, and n pairs of a lag bin (1 to 10) and its count (bins with none
-- left out).
--
-- The stats ring: bucket b (10 s of Redis time) lives in slot b % 32 as
-- fields `b<slot>` (which bucket it holds), `s<slot>` sends, `t<slot>` 429s,
-- `f<slot>` other failures. A slot still holding an older bucket is reset
-- before it counts, so the hash never grows past 128 fields.
--
-- Due lags, for a fleet-wide p95: minute m lives in slot m % 6 as `m<slot>`
-- (which minute it holds) and `L<slot>.<bin>` counts (the bins' bounds are
-- the reader's, `activity.rs`). 66 fields at most.
--
-- The hash expires 10 minutes after the last bucket began: the expiry is
-- renewed with each reset (once per 10 s while the tenant sends), not with
-- each count.
--
-- Reply: the indices (1-based) of the keys whose tenant began a stats
-- bucket, so the caller lists them as active (once per 10 s per sending
-- tenant; the active-tenant index lives outside the tenants' slots).
local STATS_BUCKET_S, STATS_SLOTS, STATS_TTL_S = 10, 32, 600
local STATS_MINUTES, LAG_BINS = 6, 10

local now = now_us(nil)
local bucket = math.floor(now / 1e6 / STATS_BUCKET_S)
local slot = tostring(bucket % STATS_SLOTS)
local minute = math.floor(now / 6e7)
local lag_slot = tostring(minute % STATS_MINUTES)

-- Adds one tenant's counts from `ARGV[arg]` on; whether they began a stats
-- bucket, and the index of the next tenant's first argument.
local function add(key, arg)
  local held = redis.call('HMGET', key, 'b' .. slot, 'm' .. lag_slot)
  local began = tonumber(held[1]) ~= bucket
  if began then
    redis.call('HSET', key, 'b' .. slot, bucket, 's' .. slot, 0, 't' .. slot, 0, 'f' .. slot, 0)
    redis.call('EXPIRE', key, STATS_TTL_S)
  end
  if ARGV[arg] ~= '0' then redis.call('HINCRBY', key, 's' .. slot, ARGV[arg]) end
  if ARGV[arg + 1] ~= '0' then redis.call('HINCRBY', key, 't' .. slot, ARGV[arg + 1]) end
  if ARGV[arg + 2] ~= '0' then redis.call('HINCRBY', key, 'f' .. slot, ARGV[arg + 2]) end

  local n = tonumber(ARGV[arg + 3])
  local next_arg = arg + 4 + 2 * n
  if n == 0 then return began, next_arg end
  if tonumber(held[2]) ~= minute then
    local reset = {'m' .. lag_slot, minute}
    for bin = 1, LAG_BINS do
      reset[#reset + 1] = 'L' .. lag_slot .. '.' .. bin
      reset[#reset + 1] = 0
    end
    redis.call('HSET', key, unpack(reset))
  end
  for i = arg + 4, next_arg - 1, 2 do
    redis.call('HINCRBY', key, 'L' .. lag_slot .. '.' .. ARGV[i], ARGV[i + 1])
  end
  return began, next_arg
end

local began, arg = {}, 1
for i, key in ipairs(KEYS) do
  local b
  b, arg = add(key, arg)
  if b then began[#began + 1] = i end
end
return began
