-- share.lua: give entries that one consumer has read, and not started on, back to its stage's
-- stream, where the idle workers blocked on it take them at once (workers/handoff.py: a burst read
-- whole by one worker is shared with its idle peers).
--
-- Each entry is added again with the same fields under a new id, then acked and deleted, in one
-- step: at every moment it is in the stream exactly once, never lost and never twice. An entry
-- that is no longer pending for this consumer (claimed by another after claim_idle_s, or already
-- gone) is left alone; the caller keeps it, as it would without sharing. So is an entry of more
-- field values than Lua's unpack can pass to XADD (a foreign producer's: ~8,000 is its limit).
--
-- KEYS[1] stage stream
-- ARGV[1] group   ARGV[2] consumer   ARGV[3..] entry ids
-- Returns the ids given back.

local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local MAX_VALUES = 7000
local given = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local pending = redis.call('XPENDING', stream, group, id, id, 1, consumer)
  if #pending == 1 then
    local entry = redis.call('XRANGE', stream, id, id)
    if #entry == 1 and #entry[1][2] <= MAX_VALUES then
      redis.call('XADD', stream, '*', unpack(entry[1][2]))
      redis.call('XACK', stream, group, id)
      redis.call('XDEL', stream, id)
      given[#given + 1] = id
    end
  end
end
return given
