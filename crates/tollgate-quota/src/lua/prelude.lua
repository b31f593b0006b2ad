-- Shared by every script (prepended when it is loaded).

-- Microseconds since the epoch: Redis `TIME`, one clock for the whole fleet,
-- unless `override` (tests and tools only) is a number.
local function now_us(override)
  if override and override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

