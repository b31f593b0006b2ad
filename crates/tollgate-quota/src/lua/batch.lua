-- The calls a pod makes while its previous one is in flight, in one round
-- trip: permit decisions (`permit.lua`) and completions (`complete.lua`),
-- each atomic, in the order they were asked for.
--
-- ARGV[1] names each group's kind, one letter per group in order:
--   'p'  a permit decision: 20 keys, 19 arguments
--   'c'  a completion: 10 keys, 8 arguments
-- The groups' keys and arguments follow, one group after another.
-- Reply: one per group, in order.
-- (On a Redis Cluster a batch must hold only keys of one slot.)

local kinds = ARGV[1]
local replies = {}
local k, a = 0, 1
for i = 1, #kinds do
  if string.sub(kinds, i, i) == 'p' then
    replies[i] = permit({unpack(KEYS, k + 1, k + 20)}, {unpack(ARGV, a + 1, a + 19)})
    k, a = k + 20, a + 19
  else
    replies[i] = complete({unpack(KEYS, k + 1, k + 10)}, {unpack(ARGV, a + 1, a + 8)})
    k, a = k + 10, a + 8
  end
end
return replies
