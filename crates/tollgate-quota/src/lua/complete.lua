-- After a provider call: record the idempotency key when the job was sent,
-- and release the in-flight lease if this attempt still holds it.
--
-- KEYS[1] sent record, KEYS[2] lease
-- ARGV[1] lease token, ARGV[2] '1' if sent, ARGV[3] record ttl ms, ARGV[4] job id

if ARGV[2] == '1' then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[3])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
return 1
