-- One audited quota change, atomically: read the old settings, apply the
-- change, stamp who/when, append old → new to the audit stream.
--
-- Seeding from the quota baseline is the same change, made only when it
-- should be: the target holds no quota and this exact baseline entry was not
-- applied before (so a deliberate `quota delete` stands until the baseline's
-- entry itself changes), or always with overwrite.
--
-- KEYS[1] settings hash, KEYS[2] audit stream,
-- KEYS[3] hash: target -> fingerprint of the baseline entry last applied,
-- KEYS[4] what the target's adaptive quota learned: forgotten when the
--         quota no longer adapts
-- KEYS[5] the set listing the target's kind (tenants, routes); absent for
--         the default quota, which is listed nowhere
-- ARGV[1] target ("tenant:acme", "route:email", "default")
-- ARGV[2] action, ARGV[3] who, ARGV[4] source ("cli", "api" or "baseline")
-- ARGV[5] the target's name in that set, ARGV[6] audit stream max length
-- ARGV[7] baseline fingerprint ('' = not a seed), ARGV[8] '1' = overwrite
-- ARGV[9..] field, value pairs; an empty value deletes the field
-- Reply: {old json, new json, 1 if written else 0}

local meta = {updated_by = true, updated_at_ms = true}
local function settings()
  local flat = redis.call('HGETALL', KEYS[1])
  local out, n = {}, 0
  for i = 1, #flat, 2 do
    if not meta[flat[i]] then out[flat[i]] = flat[i + 1]; n = n + 1 end
  end
  return out, n
end

local old = settings()
local fingerprint = ARGV[7]
if fingerprint ~= '' then
  local has_quota = redis.call('HEXISTS', KEYS[1], 'count') == 1
  local applied = redis.call('HGET', KEYS[3], ARGV[1])
  if ARGV[8] ~= '1' and (has_quota or applied == fingerprint) then
    -- A live quota wins; a deleted one stays deleted. Either way this
    -- entry counts as applied, so a later delete sticks.
    if has_quota and applied ~= fingerprint then redis.call('HSET', KEYS[3], ARGV[1], fingerprint) end
    local same = cjson.encode(old)
    return {same, same, 0}
  end
  redis.call('HSET', KEYS[3], ARGV[1], fingerprint)
end
for i = 9, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
local new, n = settings()

local at = string.format('%d', math.floor(now_us(nil) / 1000))
if new.adaptive ~= '1' then redis.call('DEL', KEYS[4]) end
if n == 0 then
  redis.call('DEL', KEYS[1])
  if KEYS[5] then redis.call('SREM', KEYS[5], ARGV[5]) end
else
  redis.call('HSET', KEYS[1], 'updated_by', ARGV[3], 'updated_at_ms', at)
  if KEYS[5] then redis.call('SADD', KEYS[5], ARGV[5]) end
end

local old_json, new_json = cjson.encode(old), cjson.encode(new)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*',
  'target', ARGV[1], 'action', ARGV[2], 'who', ARGV[3], 'source', ARGV[4],
  'at_ms', at, 'old', old_json, 'new', new_json)
return {old_json, new_json, 1}
