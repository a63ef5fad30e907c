-- backlog.lua: the requests held by each of the newest entries of a stage stream, newest first, for an
-- autoscaling supervisor's backlog in requests (broker/scaling.py): a single entry holds one, a batch
-- entry those of its `items` field (a msgpack array of 4 strings per request: only its header is read).
-- Counted here, so that the entries' payloads never cross the network.
--
-- KEYS[1] stage stream
-- ARGV[1] the most entries to count
-- Returns one count per entry, newest first.

local counts = {}
for i, entry in ipairs(redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[1])) do
  local n = 1
  local fields = entry[2]
  for f = 1, #fields - 1, 2 do
    if fields[f] == 'id' then
      n = 1
      break
    elseif fields[f] == 'items' then
      local items = fields[f + 1]
      local head = string.byte(items, 1) or 0
      local values = 0
      if head >= 0x90 and head <= 0x9f then
        values = head - 0x90
      elseif head == 0xdc and #items >= 3 then
        values = string.byte(items, 2) * 256 + string.byte(items, 3)
      elseif head == 0xdd and #items >= 5 then
        values = ((string.byte(items, 2) * 256 + string.byte(items, 3)) * 256 + string.byte(items, 4)) * 256
                 + string.byte(items, 5)
      end
      n = math.max(1, math.floor(values / 4))
    end
  end
  counts[i] = n
end
return counts
