-- janitor.lua: remove one consumer from a stage's group, only if it is dead and holds nothing
-- (broker/janitor.py says when a consumer is dead, and why the check is repeated here).
--
-- KEYS[1] stage stream  KEYS[2] heartbeat zset
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] heartbeat cutoff (Unix ms)  ARGV[4] min idle ms
-- Returns 1 if the consumer was removed, 0 if it is gone already or not dead after all.

local beat = redis.call('ZSCORE', KEYS[2], ARGV[2])
if beat and tonumber(beat) >= tonumber(ARGV[3]) then return 0 end
local consumers = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, consumer in ipairs(consumers) do
  local info = {}
  for j = 1, #consumer, 2 do info[consumer[j]] = consumer[j + 1] end
  if info['name'] == ARGV[2] then
    if tonumber(info['pending']) ~= 0 or tonumber(info['idle']) <= tonumber(ARGV[4]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    redis.call('ZREM', KEYS[2], ARGV[2])
    return 1
  end
end
return 0
