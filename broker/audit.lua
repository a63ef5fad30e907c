-- audit.lua: which of a producer's requests Redis forgot: in no stage's stream and without a result.
--
-- A request is, at every moment, an entry of exactly one stage's stream, alone or in a batch entry
-- (waiting, or pending with a worker: workers XDEL only as they forward or answer, in one script),
-- or answered (its result key is set in the same script). A request that is neither was lost by
-- Redis itself (a restart without persistence, an AOF's last second, a replica promoted before it
-- replicated, FLUSHALL, eviction): its producer should submit it again (same id, same deadline; the
-- result's SET NX keeps one answer).
--
-- One audit is a scan of the partition's streams, in order, split over calls that each read a bounded
-- part (so that no call holds Redis for long, however deep the backlog), then a check of the result
-- keys of the ids the scan did not meet. Two calls:
--
-- 'scan': KEYS the pipeline partition's stage streams, in order
--   ARGV[1] 'scan'   ARGV[2] s: the stream to go on in (1-based)   ARGV[3] the entry id to go on after
--   in it ('-' for its start). The first call of an audit passes 1 and '-'; each next one, what the
--   previous returned.
--   Returns {s, after, length, read, id, id, ...}: where the next call goes on (s = #KEYS + 1 once the
--   scan passed the end of the last stream), the total XLEN of the streams from the one this call
--   started in and the number of entries it read (a caller bounds an audit by them: a stream appended
--   faster than calls read it would never be passed), and the request ids of the entries read, batch
--   entries' included (their 'items', unpacked: a copy of their payloads inside Redis, paid only when
--   an audit runs).
-- 'unanswered': KEYS the result keys of the ids asked about, in their order
--   ARGV[1] 'unanswered'   ARGV[2..] the ids the whole scan did not meet
--   Returns those of them that have no result: forgotten.
--
-- Why the split scan misses no request that exists: a call moves on to the next stream only once it
-- has read to the end of this one (in that same call), and a request only ever moves forward: to the
-- next stage's stream or to the end of its own (a worker sharing a read, a batch entry split), both
-- after the scan's position if it was. So a request the scan never met was answered before the scan
-- ended, or lost: the result keys are read after the scan, for that reason.
--
-- Cost: each entry is read about once per audit (again only if a worker re-added it meanwhile), in
-- calls of at most MAX_ENTRIES entries and about MAX_BYTES of fields; only ids leave the server. The
-- gateway audits only requests older than its audit_after_s, at most once per audit_after_s each, and
-- stops once it met all of them: never in a steady state where requests are answered sooner.

local MAX_ENTRIES, MAX_BYTES, STEP = 256, 524288, 64

if ARGV[1] == 'unanswered' then
  local missing = {}
  for i = 2, #ARGV do
    if redis.call('EXISTS', KEYS[i - 1]) == 0 then missing[#missing + 1] = ARGV[i] end
  end
  return missing
end
if ARGV[1] ~= 'scan' then
  return redis.error_reply("audit.lua: ARGV[1] is 'scan' or 'unanswered' (see the script's header)")
end

local n = #KEYS
local s, after = tonumber(ARGV[2]), ARGV[3]
local reply = {0, '', 0, 0}
local length = 0
for k = s, n do length = length + redis.call('XLEN', KEYS[k]) end

local entries_read, bytes = 0, 0
-- This stream's entries and bytes read in this call, and the last read's count: sizes differ from one
-- stream to the next (batch entries of a batched stage), so each stream's reads start at one entry
-- and grow at most twofold a read, toward what the budget left allows at the entries' mean size.
local s_entries, s_bytes, last = 0, 0, 0
while s <= n and entries_read < MAX_ENTRIES and bytes < MAX_BYTES do
  local count = 1
  if s_bytes > 0 then
    local fits = math.floor((MAX_BYTES - bytes) * s_entries / s_bytes)
    count = math.max(1, math.min(STEP, MAX_ENTRIES - entries_read, 2 * last, fits))
  end
  local start = '-'
  if after ~= '-' then start = '(' .. after end
  local entries = redis.call('XRANGE', KEYS[s], start, '+', 'COUNT', count)
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    for f = 1, #fields, 2 do
      local value = fields[f + 1]
      bytes, s_bytes = bytes + #value, s_bytes + #value
      if fields[f] == 'id' then
        reply[#reply + 1] = value
      elseif fields[f] == 'items' then  -- a batch entry: ids at 1, 5, 9, ... of its msgpack array
        local ok, items = pcall(cmsgpack.unpack, value)
        if ok and type(items) == 'table' then
          for i = 1, #items, 4 do
            if type(items[i]) == 'string' then reply[#reply + 1] = items[i] end
          end
        end
      end
    end
    after = entry[1]
  end
  entries_read, s_entries, last = entries_read + #entries, s_entries + #entries, count
  if #entries < count then  -- the end of this stream, seen in this call: on to the next one
    s, after = s + 1, '-'
    s_entries, s_bytes, last = 0, 0, 0
  end
end

reply[1], reply[2], reply[3], reply[4] = s, after, length, entries_read
return reply
