-- The calls a pod makes while its previous one is in flight, in one round
-- trip: permit decisions (`permit.lua`) and completions (`complete.lua`),
-- each atomic, in the order they were asked for.
--
-- ARGV[1] names each group's kind, one letter per group in order:
--   'p'  a permit decision: 21 keys, 18 arguments
--   'c'  a completion: 12 keys, 12 arguments
-- The groups' keys and arguments follow, one group after another.
-- Reply: one per group, in order.
-- (On a Redis Cluster a batch must hold only keys of one slot.)

local kinds = ARGV[1]
local replies = {}
local k, a = 0, 1
for i = 1, #kinds do
  if string.sub(kinds, i, i) == 'p' then
    replies[i] = permit({unpack(KEYS, k + 1, k + 21)}, {unpack(ARGV, a + 1, a + 18)})
    k, a = k + 21, a + 18
  else
    replies[i] = complete({unpack(KEYS, k + 1, k + 12)}, {unpack(ARGV, a + 1, a + 12)})
    k, a = k + 12, a + 12
  end
end
return replies
