-- Claims cores of one host for workers of one pipeline (see broker/pins.py and workers/pinning.py).
--
-- KEYS[1]  P:pins:<host>, a zset: member "<cpu>:<stage index>:<consumer>", score = the claim's expiry
--          in ms on the host's clock (every claimant of one key runs on that host, so one clock).
-- ARGV     now_ms, ttl_ms, n, the n allowed cpus, then (consumer, stage index, hint cpu) per claim.
-- Returns  the cpu of each claim, in order.
--
-- A consumer that holds a live claim on an allowed cpu keeps it (renewed). Otherwise it takes, among
-- the allowed cpus, the one with the fewest claims of its own stage, then the fewest claims in all,
-- then the first from its hint on (cyclically): free cores first, and past one worker per core an
-- even spread. One call claims in order, atomically: a supervisor's slots are laid out together.
local key = KEYS[1]
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local allowed = {}
for i = 1, n do allowed[i] = tonumber(ARGV[3 + i]) end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now) -- claims not renewed in time: their worker is gone
local claims = {}
for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
  local cpu, stage, consumer = string.match(member, '^(%d+):(%d+):(.*)$')
  if cpu then claims[#claims + 1] = {cpu = tonumber(cpu), stage = stage, consumer = consumer, member = member} end
end

local function cost(cpu, stage)
  local same, total = 0, 0
  for _, c in ipairs(claims) do
    if c.cpu == cpu then
      total = total + 1
      if c.stage == stage then same = same + 1 end
    end
  end
  return same, total
end

local function choose(stage, hint)
  local start = 1
  for i = 1, n do if allowed[i] == hint then start = i end end
  local best, best_same, best_total
  for k = 0, n - 1 do
    local cpu = allowed[(start - 1 + k) % n + 1]
    local same, total = cost(cpu, stage)
    if best == nil or same < best_same or (same == best_same and total < best_total) then
      best, best_same, best_total = cpu, same, total
    end
  end
  return best
end

local function is_allowed(cpu)
  for i = 1, n do if allowed[i] == cpu then return true end end
  return false
end

local chosen = {}
local i = 4 + n
while i + 2 <= #ARGV do
  local consumer, stage, hint = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local cpu
  for j = #claims, 1, -1 do
    local c = claims[j]
    if c.consumer == consumer then
      if cpu == nil and is_allowed(c.cpu) and c.stage == stage then
        cpu = c.cpu
      else
        redis.call('ZADD', key, 0, c.member) -- expired: pruned by the next call (ZADD, not ZREM: the minimal ACL)
        table.remove(claims, j)
      end
    end
  end
  if cpu == nil then
    cpu = choose(stage, hint)
    claims[#claims + 1] = {cpu = cpu, stage = stage, consumer = consumer, member = cpu .. ':' .. stage .. ':' .. consumer}
  end
  redis.call('ZADD', key, now + ttl, cpu .. ':' .. stage .. ':' .. consumer)
  chosen[#chosen + 1] = cpu
  i = i + 3
end
redis.call('PEXPIRE', key, ttl)
return chosen
