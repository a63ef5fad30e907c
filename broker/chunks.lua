-- chunks.lua: one step of a streaming stage (broker/chunks.py).
--
-- KEYS[1 .. n] the reply lists to push to   KEYS[n+1 ..] the cancel markers of the items still running
-- ARGV[1] reply ttl ms   ARGV[2] n   ARGV[3 .. 2+n] the element to push to each list (a msgpack array)
-- Returns {flags, then the reply lists whose push failed with other than WRONGTYPE, each with its error}:
-- flags holds one byte per marker, '1' where it is set (the item's caller left), else '0'.
local n = tonumber(ARGV[2])
local failed = {}
for j = 1, n do
  -- A foreign producer may name a key of another type: skipped (WRONGTYPE), as commit.lua skips it.
  local pushed = redis.pcall('RPUSH', KEYS[j], ARGV[2 + j])
  if type(pushed) == 'number' then
    redis.call('PEXPIRE', KEYS[j], ARGV[1])
  elseif not string.find(pushed['err'], 'WRONGTYPE', 1, true) then
    failed[#failed + 1] = KEYS[j]
    failed[#failed + 1] = pushed['err']
  end
end
local flags = {}
-- One MGET per 1000 markers (unpack's limit; one slot: the partition's), not a call each.
for first = n + 1, #KEYS, 1000 do
  local markers = {}
  for k = first, math.min(first + 999, #KEYS) do markers[#markers + 1] = KEYS[k] end
  for _, value in ipairs(redis.call('MGET', unpack(markers))) do flags[#flags + 1] = value and '1' or '0' end
end
return {table.concat(flags), unpack(failed)}
