"""The Lua scripts that keep the index and the registry consistent, and their limits.

Each runs atomically in Redis; each touches the keys of one hash tag (one Redis
Cluster slot), so it runs the same on one Redis and on a cluster, except the two
that read many index keys of one primary (``LIVE_LOOKUP_LUA``, ``SWEEP_LUA``: they
say ``allow-cross-slot-keys`` and are sent to each primary in turn).

An index entry is a hash: field = the copy's node *slot* (a small number per node id,
``records.NodeSlots``), value = ``varint(epoch) varint(nbytes << 2 | tier) checksum[8]``
(``records.Location.encode``). So "still this epoch's" is a byte prefix (a varint is
prefix-free) and "the same bytes" is the last 8 bytes; no script parses a number, except
the sweep, which reads an epoch to compare it.
"""

LOOKUP_BATCH = 1000  # keys per pipeline flush on republish/removal
# Keys one call reads, sized so that no call holds Redis near 10 ms at 10^7 keys, where each key read
# misses the CPU's caches (docs/scale-redis.md): a sweep page (HGETALL and HDEL per key) and a SCAN.
SWEEP_PAGE = 125  # about 0.7 ms a call at 10^7 keys; the slowest seen at 250 was 9.4 ms
SCAN_PAGE = 500  # SCAN's COUNT on index walks (ls, evict, check, flush); the slowest seen at 1,000 was 7.6 ms
REGISTRY_LOG_MAX = 1000  # registry changes a client may be behind and still read only what changed
DEAD_PER_BEAT = 100  # expired beats one heartbeat collects (the next ones take the rest)
MARKER_TAG_SEARCH = 100_000  # hash tags tried to find one per cluster primary (16384 slots)

# Atomic commit of one location: ARGV = {slot, value}. A replica elsewhere whose checksum (the
# value's last 8 bytes) differs holds other bytes under the same key: drop it so readers never
# mix two versions.
COMMIT_LUA = """
local sum = string.sub(ARGV[2], -8)
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] and string.sub(fields[i + 1], -8) ~= sum then
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Remove a location only if it is still the one this node epoch wrote: ARGV = {slot, varint(epoch)}.
REMOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# Change a location's tier, only if this node epoch still holds the key (never resurrects):
# ARGV = {slot, varint(epoch), value}.
MOVE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2]) == ARGV[2] then
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


# The id's slot (its field in index entries, ``records.NodeSlots``): the one it holds, else the next
# of the counter, kept for the id across restarts until the id is forgotten. KEYS[s] = the slots
# hash, KEYS[s + 1] = the counter; the id is ARGV[n].
_SLOT_LUA = """
local function slot_of(s, n)
  local slot = redis.call('HGET', KEYS[s], ARGV[n])
  if slot then return tonumber(slot), 0 end
  slot = redis.call('INCR', KEYS[s + 1])
  redis.call('HSET', KEYS[s], ARGV[n], slot)
  return slot, 1
end
"""

# A slot for a node id that has none yet: KEYS = {slots, slot counter}, ARGV = {node id}; answers the slot.
GIVE_SLOT_LUA = _SLOT_LUA + "\nreturn (slot_of(1, 1))\n"

# A node id's claim (``NodeRegistry.claim``): KEYS = {heartbeat, claim holder, slots, slot counter},
# ARGV = {epoch, ttl ms, holder JSON, node id}. The id is taken when its heartbeat key is missing (or
# already this epoch's): the key is set to the epoch for one TTL, the holder beside it, and the answer
# is {1, the id's slot}. Held by another epoch: nothing is written, and the answer is {0, that epoch,
# the heartbeat's PTTL, its holder JSON}. One script, so two nodes claiming one id at once cannot
# both win. allow-oom: a full Redis (noeviction) must not stop a node renewing what it holds.
CLAIM_LUA = (
    "#!lua flags=allow-oom\n"
    + _SLOT_LUA
    + """
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return {1, (slot_of(3, 4))}
end
return {0, held, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or ''}
"""
)

# A heartbeat, every write of it in one script: KEYS = {heartbeat, claim holder, registry, beats,
# registry version, registry change log, slots, slot counter}, ARGV = {node id, epoch, ttl ms,
# changed, log max, dead per beat, registry entry JSON, holder JSON}.
# * Only the id's own claim is renewed: a heartbeat key holding another epoch means another process
#   took the id (this node's beat lapsed first); then nothing is written and the answer is
#   {-1, that epoch, its holder JSON}. A missing key is taken again (Redis lost it, or the beat lapsed
#   and nobody claimed the id meanwhile).
# * The registry entry is rewritten; liveness expires by Redis's clock (node clocks may differ);
#   beats that expired are collected, and a registry change is logged for this node (new, back,
#   or ARGV[4] == '1') and for each dead one.
# * The id's slot is read, or given anew if Redis lost it (then the node's index fields name a slot
#   that is no longer its own: it republishes, as for a registry entry created anew).
# Answers {1 if the registry entry was created, changes logged, the slot, 1 if the slot was given
# now}. allow-oom: a Redis at maxmemory under noeviction refuses every other write, and a node must
# not look dead for it.
BEAT_LUA = (
    "#!lua flags=allow-oom\n"
    + _SLOT_LUA
    + """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[2] then
  return {-1, held, redis.call('GET', KEYS[2]) or ''}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[8], 'PX', ARGV[3])
local slot, given = slot_of(7, 1)
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
return {created, #changed, slot, given}
"""
)

# A node that stops cleanly leaves: KEYS = {heartbeat, claim holder, registry, draining, beats, its
# tenant bytes report}, ARGV = {node id, epoch or ''}. Only while the id is still this epoch's (or nobody's; '': whoever's):
# a process that took the id since keeps its registry entry, claim and drain mark. Answers 1 if it
# left, else 0.
DEREGISTER_LUA = """
local held = redis.call('GET', KEYS[1])
if held and ARGV[2] ~= '' and held ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[6])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
return 1
"""

# Forget a node id (``kvpool check --fix``, the dead-node reaper): KEYS = {registry, draining, beats,
# slots, heartbeat}, ARGV = {node id}. Its slot goes too, unless a run holds the id's claim now (it
# started again meanwhile: its heartbeat key is set from its claim on, and it keeps its slot).
FORGET_LUA = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 0 then redis.call('HDEL', KEYS[4], ARGV[1]) end
return 1
"""

# Take the slot back from a node id the registry no longer lists (stopped cleanly, never back): KEYS =
# {registry, slots, heartbeat}, ARGV = {node id}; only while the id is neither registered nor claimed.
FORGET_SLOT_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  return redis.call('HDEL', KEYS[2], ARGV[1])
end
return 0
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

# The lookup every request pays (the live view's epochs as varints, so a copy is live when its
# value starts with its slot's bytes): which keys have a copy on a live node epoch, read where the
# index is. ARGV[1] == '1': stop after the first key with no live copy (a hit prefix);
# ARGV[2] == '1': return the live copies too; ARGV[3]: how many node id and epoch pairs
# follow (the caller's live view: slot and varint(epoch)); then more keys after KEYS. On a cluster the keys of one
# call are all served by one primary but lie in many slots, and Redis refuses declared keys
# of several slots: there KEYS holds the first and the rest follow, read under
# allow-cross-slot-keys. Returns {one '1'/'0' per key examined, {k, slot, value, ...} live
# copies, {k, slot, value, ...} copies outside the view (dead node, old epoch, or a node the
# view has not seen yet)}, k counting the call's keys from 1. Reads only.
LIVE_LOOKUP_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local live = {}
local pairs_end = 3 + 2 * tonumber(ARGV[3])
for i = 4, pairs_end, 2 do live[ARGV[i]] = ARGV[i + 1] end
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

# One step of a sweep of the index (``KeyIndex.sweep_step``, the dead-node reaper): one SCAN page of
# this primary's index keys, read and cleaned where they are, so that no call holds Redis long (a
# page is ``SWEEP_PAGE`` keys) and none waits a round trip per key. ARGV = {cursor, count, pattern,
# L, L pairs of slot and epoch (decimal), D, D dead slots}. A field is removed when its slot is
# dead, or live with an older epoch (a run of that node that has ended); a field of another slot
# stays, and its slot is answered. A key that is not a hash (not the index's) is passed over.
# Answers {next cursor, keys read, fields removed, {unknown slots}}.
SWEEP_LUA = """#!lua flags=allow-cross-slot-keys
local page = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[3], 'COUNT', ARGV[2])
local live, dead, unknown, seen = {}, {}, {}, {}
local i = 5
for _ = 1, tonumber(ARGV[4]) do
  live[ARGV[i]] = tonumber(ARGV[i + 1])
  i = i + 2
end
local ndead = tonumber(ARGV[i])
for j = i + 1, i + ndead do dead[ARGV[j]] = true end
local function epoch_of(value)
  local n, scale = 0, 1
  for j = 1, #value do
    local b = string.byte(value, j)
    n = n + (b % 128) * scale
    if b < 128 then return n end
    scale = scale * 128
  end
  return n
end
local removed = 0
for _, name in ipairs(page[2]) do
  local fields = redis.pcall('HGETALL', name)
  if type(fields) == 'table' and not fields.err then
    for f = 1, #fields, 2 do
      local slot = fields[f]
      local drop = dead[slot]
      if not drop then
        local epoch = live[slot]
        if epoch then
          drop = epoch_of(fields[f + 1]) < epoch
        elseif not seen[slot] then
          seen[slot] = true
          unknown[#unknown + 1] = slot
        end
      end
      if drop then
        redis.call('HDEL', name, slot)
        removed = removed + 1
      end
    end
  end
end
return {page[1], #page[2], removed, unknown}
"""
