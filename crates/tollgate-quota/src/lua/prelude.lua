-- Shared by every script (prepended when it is loaded).

-- Microseconds since the epoch: Redis `TIME`, one clock for the whole fleet,
-- unless `override` (tests and tools only) is a number.
local function now_us(override)
  if override and override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end


-- A lease's value: the token of the attempt that holds it, '/', and marks
-- for what that attempt's permit did which its completion undoes or learns
-- from: 'c' the token is in the tenant's in-flight set, 't' the tenant's
-- quota adapts, 'r' the route's does. So a completion skips what its
-- permit did not do, without asking. Returns the token and the marks (nil
-- when not known: a value without them).
local function lease_parts(value)
  if not value then return nil end
  local token, marks = string.match(value, '^(.*)/(%a*)$')
  if token then return token, marks end
  return value, nil
end
