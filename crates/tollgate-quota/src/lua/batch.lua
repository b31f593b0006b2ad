-- The calls a pod makes while its previous one is in flight, in one round
-- trip, each atomic, in the order they were asked for.
--
-- ARGV[1] names each group's kind, one letter per group in order:
--   'p'  a permit decision (`permit.lua`): 21 keys, 21 arguments
--   'c'  a completion (`complete.lua`): 9 keys, 8 arguments
--   'r'  a reservation on a route's slot (`route.lua`): 8 keys, 9 arguments
--   'g'  a route's send time given back (`route.lua`): 5 keys, 5 arguments
--   'R'  a route's side of a completion (`route.lua`): 3 keys, 3 arguments
-- The groups' keys and arguments follow, one group after another.
-- Reply: one per group, in order.
-- (On a Redis Cluster a batch must hold only keys of one slot.)

local groups = {
  p = {permit, 21, 21},
  c = {complete, 9, 8},
  r = {route_reserve, 8, 9},
  g = {route_give_back, 5, 5},
  R = {route_complete, 3, 3},
}
local kinds = ARGV[1]
local replies = {}
local k, a = 0, 1
for i = 1, #kinds do
  local g = groups[string.sub(kinds, i, i)]
  replies[i] = g[1]({unpack(KEYS, k + 1, k + g[2])}, {unpack(ARGV, a + 1, a + g[3])})
  k, a = k + g[2], a + g[3]
end
return replies
