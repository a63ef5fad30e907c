-- submit.lua: a producer's turn of submissions, admitted against max_backlog, in one round trip.
--
-- KEYS[1] the first stage's stream (of the requests' priority level: P:stream:0, or P:stream:0:p<L>)
-- KEYS[2] the pipeline's admission key (P:max_backlog: the first stage's max_backlog as a decimal
--         integer, written by workers at registration; "none" or absent: no limit stored in Redis)
-- KEYS[3..] result keys the producer has consumed (UNLINKed, so answered requests do not hold
--           memory until their TTL; may be none), then the h streams of ARGV[4 + 4n] (below)
-- ARGV[1] n entries   ARGV[2] the producer's own limit ('' for none; the stricter limit wins)
-- then n x (request id, data, reply key, deadline ms): an empty reply key or deadline is none (no field)
-- ARGV[3 + 4n] (optional) k: into how many batch entries to split the requests ('', absent, 0, or
--         k >= n: single entries; a fraction is rounded down)
-- ARGV[4 + 4n] (optional) h: the last h KEYS are the first stage's streams of the priority levels
--         above KEYS[1]'s, whose entries count in its backlog ('' or absent: none; else a whole number
--         from 0 to #KEYS - 2, refused otherwise before anything is written)
-- ARGV[5 + 4n] (optional) m, then m x (j, trace value): the j-th request (1-based) carries this
--         'trace' field (docs/protocol.md: a W3C traceparent, maybe timings asked); in a batch entry,
--         the entry's 'traces' field holds its requests' values in order ('' for none)
--
-- Batch entries (docs/protocol.md): with no limit in force and 1 <= k < n, the requests go as k
-- entries of fields `items` (a msgpack array of their 4 values each, in order) and `v`, split evenly
-- (sizes differ by one at most, the larger first). With a limit they stay single entries, because
-- admission counts entries (XLEN) and must count requests.
--
-- Admission: the stream holds the undelivered plus the pending entries (workers XDEL what they
-- ack), so XLEN is the first stage's backlog. A priority level's backlog is its own stream's and
-- those of the levels above it (the h last KEYS): every level has the same limit, and the lowest
-- is refused first. The first min(n, limit - backlog) entries are added, in order; the rest are not. Because the check and the XADDs run in one script, the bound holds
-- for every producer at once, whatever their number.
-- Returns the number of requests added; if requests were offered and none was added, an error
-- reply starting with OVERLOADED instead (what a foreign producer submitting one entry sees).

local n = tonumber(ARGV[1])
if n == nil or n < 0 or n % 1 ~= 0 or #ARGV < 2 + 4 * n then  -- refused before anything is written
  return redis.error_reply('ERR submit.lua: ARGV[1] must be the number n of requests, each 4 arguments after ARGV[2]')
end
-- The optional numbers read below (h, then m and its positions), checked before anything is written: a
-- producer that retries on an error reply must never have had its requests added by the call it retries.
local above = 0
local h = ARGV[4 + 4 * n]
if h ~= nil and h ~= '' then
  above = tonumber(h)
  if above == nil or above < 0 or above % 1 ~= 0 or above > #KEYS - 2 then
    return redis.error_reply('ERR submit.lua: h (the argument after k) must be a whole number from 0 to the ' ..
                             'number of KEYS after the second, got ' .. h)
  end
end
local m = ARGV[5 + 4 * n]
local n_traced = 0
if m ~= nil and m ~= '' then n_traced = tonumber(m) end
if n_traced == nil or n_traced < 0 or n_traced % 1 ~= 0 or (n_traced > 0 and #ARGV < 5 + 4 * n + 2 * n_traced) then
  return redis.error_reply('ERR submit.lua: m (the argument after h) must be the number of (position, trace) ' ..
                           'pairs that follow it, got ' .. tostring(m))
end
local traced = {}
for t = 0, n_traced - 1 do
  local j = tonumber(ARGV[6 + 4 * n + 2 * t])
  if j == nil then
    return redis.error_reply('ERR submit.lua: a trace position must be a number, got ' .. ARGV[6 + 4 * n + 2 * t])
  end
  traced[j] = ARGV[7 + 4 * n + 2 * t]
end

local admit = n
local limit = redis.call('GET', KEYS[2])
limit = tonumber(limit or '')
local own = tonumber(ARGV[2])
if own ~= nil and (limit == nil or own < limit) then limit = own end
local backlog = 0
if limit ~= nil and n > 0 then
  backlog = redis.call('XLEN', KEYS[1])
  for i = #KEYS - above + 1, #KEYS do backlog = backlog + redis.call('XLEN', KEYS[i]) end
  admit = math.max(0, math.min(n, limit - backlog))
end

local a = 3
local entries = math.floor(tonumber(ARGV[3 + 4 * n] or '') or 0)
if limit == nil and entries >= 1 and entries < admit then
  local base, extra = math.floor(admit / entries), admit % entries
  local request = 0
  for e = 1, entries do
    local size = base
    if e <= extra then size = base + 1 end
    local flat, traces, any = {}, {}, false
    for i = a, a + 4 * size - 1 do flat[#flat + 1] = ARGV[i] end
    if n_traced > 0 then
      for j = 1, size do
        traces[j] = traced[request + j] or ''
        any = any or traces[j] ~= ''
      end
    end
    request = request + size
    local items = cmsgpack.pack(flat)
    if any then
      local packed_traces = cmsgpack.pack(traces)
      redis.call('XADD', KEYS[1], '*', 'items', items, 'traces', packed_traces, 'v', '1')
    else
      redis.call('XADD', KEYS[1], '*', 'items', items, 'v', '1')
    end
    a = a + 4 * size
  end
else
  for j = 1, admit do
    local trace = n_traced > 0 and traced[j]
    if ARGV[a + 2] ~= '' and ARGV[a + 3] ~= '' then  -- a gateway's (the common case)
      if trace then
        redis.call('XADD', KEYS[1], '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'reply', ARGV[a + 2],
                   'deadline_ms', ARGV[a + 3], 'trace', trace, 'v', '1')
      else
        redis.call('XADD', KEYS[1], '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'reply', ARGV[a + 2],
                   'deadline_ms', ARGV[a + 3], 'v', '1')
      end
    else  -- an empty reply key or deadline is none: no field (workers refuse an empty 'reply'), as commit.lua
      local args = {KEYS[1], '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'v', '1'}
      if ARGV[a + 2] ~= '' then args[#args + 1] = 'reply'; args[#args + 1] = ARGV[a + 2] end
      if ARGV[a + 3] ~= '' then args[#args + 1] = 'deadline_ms'; args[#args + 1] = ARGV[a + 3] end
      if trace then args[#args + 1] = 'trace'; args[#args + 1] = trace end
      redis.call('XADD', unpack(args))
    end
    a = a + 4
  end
end

local last = #KEYS - above
if last > 2 then
  local i = 3
  while i <= last do
    local batch = {}
    for j = i, math.min(last, i + 999) do batch[#batch + 1] = KEYS[j] end
    redis.call('UNLINK', unpack(batch))
    i = i + #batch
  end
end

if admit == 0 and n > 0 then
  return redis.error_reply('OVERLOADED first stage backlog is ' .. backlog .. ' (max_backlog=' .. limit ..
                           '); retry later')
end
return admit
