"""The Lua scripts that keep the index and the registry consistent, and their limits.

Each runs atomically in Redis; each touches the keys of one hash tag (one Redis
Cluster slot), so it runs the same on one Redis and on a cluster.
"""

LOOKUP_BATCH = 1000  # keys per pipeline flush on republish/removal
REGISTRY_LOG_MAX = 1000  # registry changes a client may be behind and still read only what changed
DEAD_PER_BEAT = 100  # expired beats one heartbeat collects (the next ones take the rest)
MARKER_TAG_SEARCH = 100_000  # hash tags tried to find one per cluster primary (16384 slots)

# Atomic commit of one location. A replica elsewhere whose checksum differs holds
# other bytes under the same key: drop it so readers never mix two versions.
COMMIT_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] then
    local sum = string.match(fields[i + 1], '^[^|]*|[^|]*|[^|]*|([^|]*)')
    if sum ~= ARGV[3] then redis.call('HDEL', KEYS[1], fields[i]) end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Remove a location only if it is still the one this node epoch wrote.
REMOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# Change a location's tier, only if this node epoch still holds the key (never resurrects).
MOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""

EPOCH_FLOOR_LUA = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""

# Remove a location whatever epoch wrote it, if it still says what the caller saw.
REMOVE_EXACT_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


# A node id's claim (``NodeRegistry.claim``): KEYS = {heartbeat, claim holder}, ARGV = {epoch, ttl ms,
# holder JSON}. The id is taken when its heartbeat key is missing (or already this epoch's): the
# key is set to the epoch for one TTL, and the holder beside it. Held by another epoch: nothing is
# written, and the answer is {0, that epoch, the heartbeat's PTTL, its holder JSON}. One script,
# so two nodes claiming one id at once cannot both win. allow-oom: a full Redis (noeviction)
# must not stop a node renewing what it holds.
CLAIM_LUA = """#!lua flags=allow-oom
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return {1}
end
return {0, held, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or ''}
"""

# A heartbeat, every write of it in one script: KEYS = {heartbeat, claim holder, registry, beats,
# registry version, registry change log}, ARGV = {node id, epoch, ttl ms, changed, log max, dead
# per beat, registry entry JSON, holder JSON}.
# * Only the id's own claim is renewed: a heartbeat key holding another epoch means another process
#   took the id (this node's beat lapsed first); then nothing is written and the answer is
#   {-1, that epoch, its holder JSON}. A missing key is taken again (Redis lost it, or the beat lapsed
#   and nobody claimed the id meanwhile).
# * The registry entry is rewritten; liveness expires by Redis's clock (node clocks may differ);
#   beats that expired are collected, and a registry change is logged for this node (new, back,
#   or ARGV[4] == '1') and for each dead one.
# Answers {1 if the registry entry was created, changes logged}. allow-oom: a Redis at maxmemory
# under noeviction refuses every other write, and a node must not look dead for it.
BEAT_LUA = """#!lua flags=allow-oom
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[2] then
  return {-1, held, redis.call('GET', KEYS[2]) or ''}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[8], 'PX', ARGV[3])
local created = redis.call('HSET', KEYS[3], ARGV[1], ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = {}
if redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1]) == 1 or ARGV[4] == '1' then
  changed[1] = ARGV[1]
end
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[6]))) do
  redis.call('ZREM', KEYS[4], dead)
  changed[#changed + 1] = dead
end
for _, node in ipairs(changed) do
  redis.call('LPUSH', KEYS[6], redis.call('INCR', KEYS[5]) .. '|' .. node)
end
if #changed > 0 then redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[5]) - 1) end
return {created, #changed}
"""

# A node that stops cleanly leaves: KEYS = {heartbeat, claim holder, registry, draining, beats},
# ARGV = {node id, epoch or ''}. Only while the id is still this epoch's (or nobody's; '': whoever's):
# a process that took the id since keeps its registry entry, claim and drain mark. Answers 1 if it
# left, else 0.
DEREGISTER_LUA = """
local held = redis.call('GET', KEYS[1])
if held and ARGV[2] ~= '' and held ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
return 1
"""

# A registry change not seen by a heartbeat (deregister, forget, drain): log it for ARGV[1].
CHANGE_LUA = """
redis.call('LPUSH', KEYS[2], redis.call('INCR', KEYS[1]) .. '|' .. ARGV[1])
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[2]) - 1)
return 1
"""

# What changed since version ARGV[1] under namespace marker ARGV[3]: {version, marker, node ids...};
# {version, marker, '*'} when the log cannot say (the caller is new or behind the log, or Redis
# lost the namespace since: a new marker, and versions count again from 1): read everything.
# Nodes whose beat expired count as changed even before a heartbeat collects them: a pool
# whose last node froze is seen as empty, not waited on.
CHANGES_LUA = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local marker = redis.call('GET', KEYS[3]) or ''
local mine = tonumber(ARGV[1])
if mine <= 0 or marker ~= ARGV[3] or v < mine or v - mine > tonumber(ARGV[2]) then return {v, marker, '*'} end
local out = {v, marker}
if v > mine then
  local items = redis.call('LRANGE', KEYS[2], 0, v - mine - 1)
  if #items ~= v - mine or tonumber(string.match(items[#items], '^(%d+)|')) ~= mine + 1 then
    return {v, marker, '*'}
  end
  for _, item in ipairs(items) do out[#out + 1] = string.match(item, '^%d+|(.*)$') end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[4]))) do
  out[#out + 1] = dead
end
return out
"""

# The lookup every request pays: which keys have a copy on a live node epoch, read where the
# index is. ARGV[1] == '1': stop after the first key with no live copy (a hit prefix);
# ARGV[2] == '1': return the live copies too; ARGV[3]: how many node id and epoch pairs
# follow (the caller's live view); then more keys after KEYS. On a cluster the keys of one
# call are all served by one primary but lie in many slots, and Redis refuses declared keys
# of several slots: there KEYS holds the first and the rest follow, read under
# allow-cross-slot-keys. Returns {one '1'/'0' per key examined, {k, node, value, ...} live
# copies, {k, node, value, ...} copies outside the view (dead node, old epoch, or a node the
# view has not seen yet)}, k counting the call's keys from 1. Reads only.
LIVE_LOOKUP_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local live = {}
local pairs_end = 3 + 2 * tonumber(ARGV[3])
for i = 4, pairs_end, 2 do live[ARGV[i]] = ARGV[i + 1] .. '|' end
local names = KEYS
if #ARGV > pairs_end then
  names = {}
  for i = 1, #KEYS do names[i] = KEYS[i] end
  for i = pairs_end + 1, #ARGV do names[#names + 1] = ARGV[i] end
end
local stop, want = ARGV[1] == '1', ARGV[2] == '1'
local hits, copies, others = {}, {}, {}
for k = 1, #names do
  local fields = redis.call('HGETALL', names[k])
  local hit = '0'
  for i = 1, #fields, 2 do
    local node, value = fields[i], fields[i + 1]
    local epoch = live[node]
    local out = others
    if epoch and string.sub(value, 1, #epoch) == epoch then
      hit = '1'
      out = want and copies or nil
    end
    if out then
      out[#out + 1] = k
      out[#out + 1] = node
      out[#out + 1] = value
    end
  end
  hits[k] = hit
  if stop and hit == '0' then break end
end
return {table.concat(hits), copies, others}
"""
