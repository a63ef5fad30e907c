-- cancel.lua: requests whose callers left (docs/protocol.md, Cancellation), in one call.
--
-- KEYS[1] the partition's flag P:cancels   KEYS[2 ..] one marker P:cancel:<id> per request
-- ARGV[j] the marker of KEYS[j + 1]'s time to live, ms (until the request's deadline, and a second)
--
-- Each marker is SET with its TTL; the flag lives as long as the longest marker of late, so that a
-- worker that finds no flag knows no marker is live and looks for none (broker/cancels.py).
-- Returns the number of markers set.
local longest = 0
for j = 2, #KEYS do
  local ttl = tonumber(ARGV[j - 1])
  redis.call('SET', KEYS[j], '1', 'PX', ttl)
  if ttl > longest then longest = ttl end
end
if longest > 0 and redis.call('PTTL', KEYS[1]) < longest then
  redis.call('SET', KEYS[1], '1', 'PX', longest)
end
return #KEYS - 1
