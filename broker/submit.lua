-- submit.lua: a gateway's turn of submissions, in one round trip.
--
-- KEYS[1] the first stage's stream; KEYS[2..] result keys the gateway has consumed (UNLINKed,
-- so answered requests do not hold memory until their TTL).
-- ARGV[1] n entries, then n x (request id, data, reply key, deadline ms).
-- Returns the stream's length after the additions (the gateway's backlog estimate).

local n = tonumber(ARGV[1])
local a = 2
for _ = 1, n do
  redis.call('XADD', KEYS[1], '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'reply', ARGV[a + 2],
             'deadline_ms', ARGV[a + 3], 'v', '1')
  a = a + 4
end
if #KEYS > 1 then
  local i = 2
  while i <= #KEYS do
    local batch = {}
    for j = i, math.min(#KEYS, i + 999) do batch[#batch + 1] = KEYS[j] end
    redis.call('UNLINK', unpack(batch))
    i = i + #batch
  end
end
return redis.call('XLEN', KEYS[1])
