-- One quota change, atomically: read the old settings, apply the change,
-- stamp who/when, and answer old → new for the audit stream.
--
-- Seeding from the quota baseline is the same change, made only when it
-- should be: the target holds no quota and this exact baseline entry was not
-- applied before (so a deliberate `quota delete` stands until the baseline's
-- entry itself changes), or always with overwrite.
--
-- KEYS[1] settings hash
-- KEYS[2] the target's baseline mark: the fingerprint of the baseline entry
--         last applied to it
-- KEYS[3] what the target's adaptive quota learned: forgotten when the
--         quota no longer adapts
-- KEYS[4..6] a tenant's lines of places (normal, high, low priority):
--         emptied when it is paused or resumed
-- ARGV[1] who
-- ARGV[2] the fingerprint an older installation kept for the target, if
--         the mark is absent ('' = none)
-- ARGV[3] baseline fingerprint ('' = not a seed), ARGV[4] '1' = overwrite
-- ARGV[5..] field, value pairs; an empty value deletes the field
-- Reply: {old json, new json, 1 if written else 0, 1 if the target holds
-- settings afterwards else 0, when (ms)}
--
-- Every key is the target's (its slot on a Redis Cluster). The caller
-- writes the rest of a written change: the audit entry, and the target's
-- listing in the tenants' or routes' index.

local meta = {updated_by = true, updated_at_ms = true}
local function settings()
  local flat = redis.call('HGETALL', KEYS[1])
  local out, n = {}, 0
  for i = 1, #flat, 2 do
    if not meta[flat[i]] then out[flat[i]] = flat[i + 1]; n = n + 1 end
  end
  return out, n
end

local old, held = settings()
local at = string.format('%d', math.floor(now_us(nil) / 1000))
local fingerprint = ARGV[3]
if fingerprint ~= '' then
  local has_quota = redis.call('HEXISTS', KEYS[1], 'count') == 1
  local applied = redis.call('GET', KEYS[2])
  if not applied and ARGV[2] ~= '' then
    -- Carried over from where an older installation kept it.
    applied = ARGV[2]
    redis.call('SET', KEYS[2], applied)
  end
  if ARGV[4] ~= '1' and (has_quota or applied == fingerprint) then
    -- A live quota wins; a deleted one stays deleted. Either way this
    -- entry counts as applied, so a later delete sticks.
    if has_quota and applied ~= fingerprint then redis.call('SET', KEYS[2], fingerprint) end
    local same = cjson.encode(old)
    return {same, same, 0, held > 0 and 1 or 0, tonumber(at)}
  end
  redis.call('SET', KEYS[2], fingerprint)
end
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
local new, n = settings()

if new.adaptive ~= '1' then redis.call('DEL', KEYS[3]) end
-- Paused, a tenant's jobs are parked without their places, and come back
-- after the resume as new: places left in its lines would only pass unused
-- ahead of them (a 30-job line at 1/s paused for 5 s sent nothing for 23 s
-- after the resume).
if KEYS[6] and old.paused ~= new.paused then redis.call('DEL', KEYS[4], KEYS[5], KEYS[6]) end
if n == 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'updated_by', ARGV[1], 'updated_at_ms', at)
end
return {cjson.encode(old), cjson.encode(new), 1, n > 0 and 1 or 0, tonumber(at)}
