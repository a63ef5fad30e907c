-- commit.lua: one atomic step for a whole batch of one stage.
--
-- Forwards items to the next stage's stream (one entry each, or batch entries of several: see
-- broker/protocol.py), publishes results and errors (first write
-- wins: SET NX), notifies each reply list once per batch, dead-letters rejected entries,
-- records batch stats (when the worker hands a period's worth), then XACKs the consumed entries
-- and removes them from the stream. Because everything happens in one script, an entry is acked
-- and removed if and only if its next step is in Redis.
--
-- KEYS[1] in stream   KEYS[2] out stream (unused if no forwards)   KEYS[3] dead-letter stream
-- KEYS[4] stats stream   KEYS[5 .. 4+n_res] the result keys, in the order of the records below
-- KEYS[5+n_res ..] the reply keys, referenced by index below
--
-- ARGV[1] group  ARGV[2] result ttl ms  ARGV[3] reply ttl ms  ARGV[4] stage name
-- ARGV[5] n_ack  ARGV[6] n_fwd  ARGV[7] n_res  ARGV[8] n_dead
-- ARGV[9] batch sizes, ARGV[10] durations ms: space-separated, one value per batch since the worker's
--   last stats entry ('' for no entry now; workers hand them about every 100 ms, not per batch)
-- ARGV[11] n_groups: the results in groups of one reply key each
-- ARGV[12] n_packed: batch entries forwarded   ARGV[13] n_back: items put back on the in stream
-- ARGV[14] n_trace: single entries that carry a trace   ARGV[15] n_ptrace: batch entries that do
-- ARGV[16] items' stream waits, ARGV[17] exemplars: the stats entry's fields 'w' and 'x' ('' for none;
--   broker/commit.py BatchStats), written with ARGV[9] and ARGV[10]
-- then n_trace x (j, trace value): the j-th single entry added below (forwards first, then the
--   items put back; 1-based) gets the field 'trace' (docs/protocol.md; most batches have none)
-- then n_ptrace x (e, traces): the e-th batch entry forwarded gets the field 'traces'
-- then n_fwd x (request id, data, reply or '', deadline ms or '')
-- then n_packed x a batch entry's items (its 'items' field)
-- then n_back x (request id, data, reply or '', deadline ms or ''): a batch entry delivered again,
--   split into single entries of its own stage (so that one item that kills its worker does not take
--   the batch's other items to the dead-letter stream with it); the batch entry is among the acks
-- then n_groups x (KEYS index of the group's reply key or 0 for none, k), each followed by its
--   k records (the groups' k add up to n_res; record j of all of them is KEYS[4 + j]'s)
-- then n_dead x (entry id, request id or '', reason, data excerpt)
-- then n_ack x entry id
-- then, for a batch of several priority levels (workers/loop/priorities.py), each other level's part, to
--   the end of ARGV: KEYS index of its in stream, of its out stream, n_ack, n_fwd, n_packed, n_trace,
--   n_ptrace, then its traces, ptraces, forwards, batch entries and acks as above (its results and dead
--   letters ride with the batch's: only the streams are a level's own)
-- Returns {number of results written (duplicates are not), an array of the reply keys whose push failed
-- (a refusal, or WRONGTYPE: a key of another type; the worker logs it), each followed by its error, an
-- array of the positions (1-based, as KEYS[4 + j]) of the results whose key held an answer already (so
-- not written), and an array of the dead-letter or stats streams an XADD failed on, each with its error}.
--
-- Removal of acked entries: a batch of TRIM_FROM entries or more is removed by one XTRIM MINID rather
-- than one XDEL each (an XDEL seeks its entry through the stream's node and, for the stream's first
-- entry, past the deleted ones before it: under load that cost more than the rest of the commit).
-- Every entry older than the oldest one still pending was delivered (a group delivers in id order)
-- and is not pending, so it was acked: the bound is the oldest entry pending after the ack or, when
-- every pending entry was this batch's, just past the newest of them. Entries of this batch at or
-- past the bound (a peer's batch, read before this one, still runs) get an XDEL. So, as before, the
-- stream holds exactly the undelivered and the pending entries after every commit (its XLEN is the
-- backlog that admission reads).

local function array_header(n)
  if n < 16 then return string.char(0x90 + n) end
  if n < 65536 then return string.char(0xdc, math.floor(n / 256), n % 256) end
  return string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                     math.floor(n / 256) % 256, n % 256)
end

-- An entry id's two numbers (ms, seq); nil for numbers too large to count on exactly (and to write
-- back as digits: Lua writes numbers of 1e14 and more with an exponent).
local function id_parts(id)
  local dash = string.find(id, '-', 1, true)
  local ms, seq = tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
  if ms >= 1e14 or seq >= 1e14 - 1 then return nil end
  return ms, seq
end

-- Batches of fewer entries are removed with one XDEL: below this, the XPENDING calls the trim needs
-- cost more than the XDEL's seeks they save (bench.peers.redis_cost --batch 4 and 32).
local TRIM_FROM = 8

local group, result_ttl, reply_ttl, stage = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n_ack, n_fwd = tonumber(ARGV[5]), tonumber(ARGV[6])
local n_res, n_dead, n_groups = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[11])
local n_packed, n_back = tonumber(ARGV[12]), tonumber(ARGV[13])
local n_trace, n_ptrace = tonumber(ARGV[14]), tonumber(ARGV[15])
local a = 18

local traced, ptraced, single = {}, {}, 0

-- The trace values of a part's single entries and batch entries (ARGV from a on).
local function read_traces(n, np)
  traced, ptraced, single = {}, {}, 0
  for _ = 1, n do traced[tonumber(ARGV[a])] = ARGV[a + 1]; a = a + 2 end
  for _ = 1, np do ptraced[tonumber(ARGV[a])] = ARGV[a + 1]; a = a + 2 end
end

local function add_singles(stream, n)
  for _ = 1, n do
    local args = {stream, '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'v', '1'}
    if ARGV[a + 2] ~= '' then args[#args + 1] = 'reply'; args[#args + 1] = ARGV[a + 2] end
    if ARGV[a + 3] ~= '' then args[#args + 1] = 'deadline_ms'; args[#args + 1] = ARGV[a + 3] end
    single = single + 1
    if traced[single] then args[#args + 1] = 'trace'; args[#args + 1] = traced[single] end
    redis.call('XADD', unpack(args))
    a = a + 4
  end
end

local function add_packed(stream, n)
  for e = 1, n do
    if ptraced[e] then
      redis.call('XADD', stream, '*', 'items', ARGV[a], 'traces', ptraced[e], 'v', '1')
    else
      redis.call('XADD', stream, '*', 'items', ARGV[a], 'v', '1')
    end
    a = a + 1
  end
end

read_traces(n_trace, n_ptrace)
add_singles(KEYS[2], n_fwd)
add_packed(KEYS[2], n_packed)
add_singles(KEYS[1], n_back)

local written, failed, kept, k = 0, {}, {}, 5
for _ = 1, n_groups do
  local rep, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local records = {}
  a = a + 2
  for j = a, a + count - 1 do
    if redis.call('SET', KEYS[k], ARGV[j], 'NX', 'PX', result_ttl) then
      records[#records + 1] = ARGV[j]
    else
      kept[#kept + 1] = k - 4  -- its key held an answer already: a re-run, or a request id used again
    end
    k = k + 1
  end
  a = a + count
  written = written + #records
  if rep > 0 and #records > 0 then
    -- A foreign producer may name a key of another type: pcall skips it (WRONGTYPE) rather than
    -- failing the batch, for one command instead of a TYPE check and the push; the worker says so.
    local key = KEYS[rep]
    local pushed = redis.pcall('RPUSH', key, array_header(#records) .. table.concat(records))
    if type(pushed) == 'number' then
      redis.call('PEXPIRE', key, reply_ttl)
    else
      failed[#failed + 1] = key
      failed[#failed + 1] = pushed['err']
    end
  end
end

-- The dead letters and the stats come after the forwards, and a script's writes are not undone when a
-- later one fails: a key of another type there (an operator's, another app's) must not fail the batch,
-- which would leave its forwards made and its entries pending, forwarded again at each delivery. pcall:
-- what could not be written is returned (the worker says so); the requests were answered all the same.
-- But for OOM: Redis refuses only a script's first write for memory, so then nothing is written yet, and
-- failing keeps the batch pending (its dead letters come once memory does).
local unwritten = {}
local function add_or_say(key, ...)
  local added = redis.pcall('XADD', key, ...)
  if type(added) == 'table' and added['err'] then
    if string.sub(added['err'], 1, 3) == 'OOM' then error(added) end
    if #unwritten < 8 then
      unwritten[#unwritten + 1] = key
      unwritten[#unwritten + 1] = added['err']
    end
  end
end

for _ = 1, n_dead do
  add_or_say(KEYS[3], 'MAXLEN', '~', 10000, '*', 'entry', ARGV[a], 'id', ARGV[a + 1], 'stage', stage,
             'reason', ARGV[a + 2], 'data', ARGV[a + 3])
  a = a + 4
end

if ARGV[9] ~= '' then
  if ARGV[16] ~= '' then
    add_or_say(KEYS[4], 'MAXLEN', '~', 1000, '*', 'n', ARGV[9], 'ms', ARGV[10], 'w', ARGV[16], 'x', ARGV[17])
  else
    add_or_say(KEYS[4], 'MAXLEN', '~', 1000, '*', 'n', ARGV[9], 'ms', ARGV[10])
  end
end

-- ids (a table) in chunks of at most 1000 (unpack's limit).
local function chunks(ids)
  if #ids == 0 then return {} end
  if #ids <= 1000 then return {ids} end
  local out, i = {}, 0
  while i < #ids do
    local chunk = {}
    for j = 1, math.min(1000, #ids - i) do chunk[j] = ids[i + j] end
    out[#out + 1] = chunk
    i = i + #chunk
  end
  return out
end

-- Acks a part's n_ack entry ids (ARGV from a on) in ``stream`` and removes them from it.
local function ack_and_remove(stream, n_ack)
  local acks, acked, late = {}, 0, {}
  for j = 1, n_ack do acks[j] = ARGV[a + j - 1] end
  a = a + n_ack
  local before = n_ack >= TRIM_FROM and redis.call('XPENDING', stream, group)  -- count, oldest, newest, consumers
  for _, ids in ipairs(chunks(acks)) do acked = acked + redis.call('XACK', stream, group, unpack(ids)) end
  if before then
    local alone = before[1] == acked  -- every pending entry was this batch's: none is pending now
    local bound_ms, bound_seq
    if alone and before[3] then
      bound_ms, bound_seq = id_parts(before[3])
      if bound_seq then bound_seq = bound_seq + 1 end
    elseif not alone then
      bound_ms, bound_seq = id_parts(redis.call('XPENDING', stream, group)[2])
    end
    if bound_seq then
      redis.call('XTRIM', stream, 'MINID', bound_ms .. '-' .. bound_seq)
      for _, id in ipairs(alone and {} or acks) do  -- the entries of this batch the trim leaves
        local ms, seq = id_parts(id)
        if not seq or ms > bound_ms or (ms == bound_ms and seq >= bound_seq) then late[#late + 1] = id end
      end
    else
      late = acks
    end
  else
    late = acks
  end
  for _, ids in ipairs(chunks(late)) do redis.call('XDEL', stream, unpack(ids)) end
end

ack_and_remove(KEYS[1], n_ack)
while a <= #ARGV do  -- the other levels' parts of a batch of several
  local in_key, out_key = KEYS[tonumber(ARGV[a])], KEYS[tonumber(ARGV[a + 1])]
  local acks_n, fwd_n, packed_n = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local trace_n, ptrace_n = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  a = a + 7
  read_traces(trace_n, ptrace_n)
  add_singles(out_key, fwd_n)
  add_packed(out_key, packed_n)
  ack_and_remove(in_key, acks_n)
end
return {written, failed, kept, unwritten}  -- tables, never unpacked: a batch may hold thousands of failed pushes
