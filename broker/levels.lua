-- levels.lua: a worker's first read of a batch on a stage with priority levels (docs/protocol.md,
-- Priorities): new entries of the first of the given level streams that has any, then, while the
-- batch has room, of the streams after it.
--
-- A Redis stream has no priority, so each level has a stream of its own; one XREADGROUP naming
-- several would deliver COUNT entries of every level that has some, and a worker would then hold
-- lower-level entries past its batch while it serves a higher level. Here the first stream with
-- entries is read first, and a later stream only for the room left in the batch (ARGV[3] = 1), so
-- a lone urgent request rides in a batch of the default level's backlog instead of costing a batch
-- of its own, and nothing past the batch is taken from anyone. A script cannot block: a worker that
-- finds nothing here blocks on every level at once.
--
-- KEYS[1..n] the stage's level streams of one partition, in the order to try (highest first, or the
--            lowest first when the worker's starvation guard is due)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] fill: 1 to read later streams into the room left, 0 not
-- ARGV[3 + i] COUNT for KEYS[i]
-- Returns {i, XREADGROUP's reply, j, reply, ...} for the streams read, in KEYS order, or nil when none
-- has new entries.

local out, room = {}, nil
for i = 1, #KEYS do
  local count = tonumber(ARGV[3 + i])
  if room ~= nil and room < count then count = room end
  if count > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[i], '>')
    if reply then
      out[#out + 1] = i
      out[#out + 1] = reply
      if ARGV[3] ~= '1' then break end
      room = count - #reply[1][2]
      if room <= 0 then break end
    end
  end
end
if #out == 0 then return false end
return out
