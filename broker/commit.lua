-- commit.lua: one atomic step for a whole batch of one stage.
--
-- Forwards items to the next stage's stream, publishes results and errors (first write
-- wins: SET NX), notifies each reply list once per batch, dead-letters rejected entries,
-- records batch stats (when the worker hands a period's worth), then XACKs and XDELs the consumed entries. Because everything
-- happens in one script, an entry is acked if and only if its next step is in Redis.
--
-- KEYS[1] in stream   KEYS[2] out stream (unused if no forwards)   KEYS[3] dead-letter stream
-- KEYS[4] stats stream   KEYS[5..] result keys and reply keys, referenced by index below
--
-- ARGV[1] group  ARGV[2] result ttl ms  ARGV[3] reply ttl ms  ARGV[4] stage name
-- ARGV[5] n_ack  ARGV[6] n_fwd  ARGV[7] n_res  ARGV[8] n_dead
-- ARGV[9] batch sizes, ARGV[10] durations ms: space-separated, one value per batch since the worker's
--   last stats entry ('' for no entry now; workers hand them about every 100 ms, not per batch)
-- then n_fwd x (request id, data, reply or '', deadline ms or '')
-- then n_res x (KEYS index of result key, record, KEYS index of reply key or 0)
-- then n_dead x (entry id, request id or '', reason, data excerpt)
-- then n_ack x entry id
-- Returns {number of results written (duplicates are not), then the reply keys whose push failed
-- with something other than WRONGTYPE (a refusal: the worker logs it), each followed by its error}.

local function array_header(n)
  if n < 16 then return string.char(0x90 + n) end
  if n < 65536 then return string.char(0xdc, math.floor(n / 256), n % 256) end
  return string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                     math.floor(n / 256) % 256, n % 256)
end

local group, result_ttl, reply_ttl, stage = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n_ack, n_fwd = tonumber(ARGV[5]), tonumber(ARGV[6])
local n_res, n_dead = tonumber(ARGV[7]), tonumber(ARGV[8])
local a = 11

for _ = 1, n_fwd do
  local args = {KEYS[2], '*', 'id', ARGV[a], 'data', ARGV[a + 1], 'v', '1'}
  if ARGV[a + 2] ~= '' then args[#args + 1] = 'reply'; args[#args + 1] = ARGV[a + 2] end
  if ARGV[a + 3] ~= '' then args[#args + 1] = 'deadline_ms'; args[#args + 1] = ARGV[a + 3] end
  redis.call('XADD', unpack(args))
  a = a + 4
end

local written, replies, order, failed = 0, {}, {}, {}
for _ = 1, n_res do
  local record, rep = ARGV[a + 1], tonumber(ARGV[a + 2])
  if redis.call('SET', KEYS[tonumber(ARGV[a])], record, 'NX', 'PX', result_ttl) then
    written = written + 1
    if rep > 0 then
      local key = KEYS[rep]
      if replies[key] == nil then replies[key] = {}; order[#order + 1] = key end
      local list = replies[key]
      list[#list + 1] = record
    end
  end
  a = a + 3
end

for _, key in ipairs(order) do
  -- A foreign producer may name a key of another type: pcall skips it (WRONGTYPE) rather than
  -- failing the batch, for one command instead of a TYPE check and the push.
  local records = replies[key]
  local pushed = redis.pcall('RPUSH', key, array_header(#records) .. table.concat(records))
  if type(pushed) == 'number' then
    redis.call('PEXPIRE', key, reply_ttl)
  elseif not string.find(pushed['err'], 'WRONGTYPE', 1, true) then
    failed[#failed + 1] = key
    failed[#failed + 1] = pushed['err']
  end
end

for _ = 1, n_dead do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'entry', ARGV[a], 'id', ARGV[a + 1],
             'stage', stage, 'reason', ARGV[a + 2], 'data', ARGV[a + 3])
  a = a + 4
end

if ARGV[9] ~= '' then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', 1000, '*', 'n', ARGV[9], 'ms', ARGV[10])
end

local i = 0
while i < n_ack do
  local ids = {}
  for j = 1, math.min(1000, n_ack - i) do ids[j] = ARGV[a + i + j - 1] end
  redis.call('XACK', KEYS[1], group, unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
  i = i + #ids
end
return {written, unpack(failed)}
