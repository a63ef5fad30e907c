-- levels.lua: a worker's first read of a batch on a stage with priority levels (docs/protocol.md,
-- Priorities): new entries of the first of the given level streams that has any, and of no other.
--
-- A Redis stream has no priority, so each level has a stream of its own; one XREADGROUP naming
-- several would deliver entries of every level that has some (COUNT is per stream), and a worker
-- would then hold lower-level entries while it serves a higher level. Here only the first stream
-- with entries is read, so the lower levels' entries stay in their streams for whoever comes next.
-- A script cannot block: a worker that finds nothing here blocks on every level at once.
--
-- KEYS[1..n] the stage's level streams of one partition, in the order to try (highest first, or the
--            lowest first when the worker's starvation guard is due)
-- ARGV[1] group   ARGV[2] consumer   ARGV[2 + i] COUNT for KEYS[i]
-- Returns {i, XREADGROUP's reply} for the stream read, or nil when none has new entries.

for i = 1, #KEYS do
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[2 + i], 'STREAMS', KEYS[i], '>')
  if reply then return {i, reply} end
end
return false
