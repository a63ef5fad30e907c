-- audit.lua: which of a producer's requests Redis forgot: in no stage's stream and without a result.
--
-- A request is, at every moment, an entry of exactly one stage's stream, alone or in a batch entry
-- (waiting, or pending with a worker: workers XDEL only as they forward or answer, in one script),
-- or answered (its result key is set in the same script). A request that is neither was lost by
-- Redis itself (a restart without persistence, an AOF's last second, a replica promoted before it
-- replicated, FLUSHALL, eviction): its producer should submit it again (same id, same deadline; the
-- result's SET NX keeps one answer). A batch entry's ids are read by unpacking its 'items' (cmsgpack):
-- a copy of its payloads inside Redis, paid only when an audit runs.
--
-- KEYS[1..n]   the pipeline partition's stage streams, in order (n = ARGV[1])
-- KEYS[n+1..]  the result keys of the requests asked about, in the order of their ids below
-- ARGV[1] n    ARGV[2..] the request ids asked about
-- Returns the ids that are in no stream and have no result.
--
-- Cost: a scan of every entry of the partition's streams, in Redis (only ids are compared; no entry
-- leaves the server). The gateway runs it only for requests older than its audit_after_s, at most
-- once per audit_after_s each: never in a steady state where requests are answered sooner.

local n = tonumber(ARGV[1])
local wanted, left = {}, 0
for i = 2, #ARGV do
  if redis.call('EXISTS', KEYS[n + i - 1]) == 0 then
    wanted[ARGV[i]] = true
    left = left + 1
  end
end

local function found(id)
  if wanted[id] then
    wanted[id] = nil
    left = left - 1
  end
end

for s = 1, n do
  if left == 0 then break end
  local start = '-'
  while left > 0 do
    local entries = redis.call('XRANGE', KEYS[s], start, '+', 'COUNT', 1000)
    for _, entry in ipairs(entries) do
      local fields = entry[2]
      for f = 1, #fields, 2 do
        if fields[f] == 'id' then
          found(fields[f + 1])
          break
        elseif fields[f] == 'items' then  -- a batch entry: ids at 1, 5, 9, ... of its msgpack array
          local ok, items = pcall(cmsgpack.unpack, fields[f + 1])
          if ok and type(items) == 'table' then
            for i = 1, #items, 4 do found(items[i]) end
          end
          break
        end
      end
    end
    if #entries < 1000 then break end
    start = '(' .. entries[#entries][1]
  end
end

local missing = {}
for i = 2, #ARGV do
  if wanted[ARGV[i]] then missing[#missing + 1] = ARGV[i] end
end
return missing
