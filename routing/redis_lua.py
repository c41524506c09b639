"""Lua scripts run inside Redis: each is one atomic step shared by every gateway.

ROUTE_AND_RESERVE reads each candidate's live leases and pending prefill, its shared predicted
prefix, computes the prefix cost (routing/policies/prefix_cost.py, same formula and window), picks,
and books the lease - so two gateways can never both take the last slot of a replica. Load is
counted as routing/load.py counts it: only leases of priority <= the request's (a lease booked
without a priority counts for everyone). The in-flight cap counts every lease.

Keys per candidate i: KEYS[4i-3] lease ZSET (request id -> expiry ms), KEYS[4i-2] pending HASH
(request id -> uncached prefill tokens), KEYS[4i-1] predicted ZSET (block hash -> expiry ms),
KEYS[4i] priority HASH (request id -> priority); the last key is the new-prefix rotation HASH
(replica -> turn). Predicted members are block hashes as 8 little-endian bytes. A candidate's
hint is its rendezvous weight for the request's routing hint plus one (0: no hint), so every
gateway finds the same home (routing/policies/prefix_cost.py says when a hint counts).
"""

ROUTE_AND_RESERVE = r"""
local now = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local pred_ttl_ms = tonumber(ARGV[3])
local request_id = ARGV[4]
local prompt_tokens = tonumber(ARGV[5])
local block_size = tonumber(ARGV[6])
local rand = tonumber(ARGV[7])
local window_abs = tonumber(ARGV[8])
local window_rel = tonumber(ARGV[9])
local uncached_weight = tonumber(ARGV[10])
local batch_scale = tonumber(ARGV[11])
local near_equal = tonumber(ARGV[12])
local n = tonumber(ARGV[13])
local priority = tonumber(ARGV[14])
local per = 7
-- Block hashes arrive packed as 8 bytes each in one argument and are used as binary members.
local packed = ARGV[15 + n * per] or ''
local hashes = {}
for j = 1, #packed, 8 do hashes[#hashes + 1] = string.sub(packed, j, j + 7) end
local max_blocks = math.max(0, math.floor((prompt_tokens - 1) / block_size))
local rotation_key = KEYS[#KEYS]

local cands = {}
for i = 1, n do
  local o = 14 + (i - 1) * per
  local lease, pend, pred, prio = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', lease, '-inf', now)
    for k = 1, #expired, 1000 do
      local last = math.min(k + 999, #expired)
      redis.call('HDEL', pend, unpack(expired, k, last))
      redis.call('HDEL', prio, unpack(expired, k, last))
    end
  end
  local leases = redis.call('ZCARD', lease)
  local competing, pending = leases, 0
  local flat = redis.call('HGETALL', prio)
  if #flat == 0 then
    for _, v in ipairs(redis.call('HVALS', pend)) do pending = pending + tonumber(v) end
  else
    -- Leases of lower priority (a higher value) leave the count; unknown ones stay in it.
    local lower = {}
    for j = 1, #flat, 2 do
      if tonumber(flat[j + 1]) > priority then lower[flat[j]] = true; competing = competing - 1 end
    end
    local pend_flat = redis.call('HGETALL', pend)
    for j = 1, #pend_flat, 2 do
      if not lower[pend_flat[j]] then pending = pending + tonumber(pend_flat[j + 1]) end
    end
  end
  local in_flight = math.max(competing, tonumber(ARGV[o + 5]))
  pending = math.max(pending, tonumber(ARGV[o + 6]))
  redis.call('ZREMRANGEBYSCORE', pred, '-inf', now)
  -- The gateway's own index already vouches for the first local_blocks blocks; look up shared
  -- predictions only past them, in small chunks, since most replicas miss at once.
  local local_blocks = math.floor(tonumber(ARGV[o + 2]) / block_size)
  local blocks = local_blocks
  local k = local_blocks + 1
  while k <= #hashes do
    local last = math.min(k + 31, #hashes)
    local scores = redis.call('ZMSCORE', pred, unpack(hashes, k, last))
    local stop = false
    for j = 1, #scores do
      if scores[j] then blocks = blocks + 1 else stop = true; break end
    end
    if stop then break end
    k = last + 1
  end
  local cached = math.max(tonumber(ARGV[o + 2]), math.min(blocks, max_blocks) * block_size)
  local c = {name = ARGV[o + 1], cached = cached, in_flight = in_flight, pending = pending,
             cap = tonumber(ARGV[o + 3]), saturated = tonumber(ARGV[o + 4]), index = i,
             local_blocks = local_blocks, leases = leases, hint = tonumber(ARGV[o + 7])}
  local uncached = math.max(0, prompt_tokens - cached)
  c.cost = (uncached_weight * uncached + pending + block_size) * (1 + in_flight / batch_scale)
  cands[#cands + 1] = c
end

local function explain(chosen, reason)
  -- One JSON string: far cheaper for the client to parse than a long multi-bulk reply.
  local rows = {}
  for _, c in ipairs(cands) do
    rows[#rows + 1] = {c.name, c.cached, c.in_flight, c.pending, c.cost}
  end
  return cjson.encode({chosen, reason, rows})
end

local open, healthy = {}, {}
for _, c in ipairs(cands) do
  if c.cap <= 0 or math.max(c.leases, c.in_flight) < c.cap then
    open[#open + 1] = c
    if c.saturated == 0 then healthy[#healthy + 1] = c end
  end
end
if #open == 0 then return explain('', 'no_capacity') end
local pool = healthy
local all_saturated = (#healthy == 0)
if all_saturated then pool = open end

local lo = math.huge
for _, c in ipairs(pool) do lo = math.min(lo, c.in_flight) end
local limit = lo + math.max(window_abs, window_rel * lo)
local window, best, best_cached = {}, math.huge, 0
for _, c in ipairs(pool) do
  best_cached = math.max(best_cached, c.cached)
  if c.in_flight <= limit then
    window[#window + 1] = c
    best = math.min(best, c.cost)
  end
end
local near = {}
for _, c in ipairs(window) do
  if c.cost <= best * (1 + near_equal) then near[#near + 1] = c end
end

local function home(list)
  local h = list[1]
  for _, c in ipairs(list) do if c.hint > h.hint then h = c end end
  return h
end
local hinted = window[1].hint > 0
local reason, chosen
if best_cached == 0 and hinted then
  chosen = home(window)
  reason = 'session_hint'
elseif best_cached == 0 then
  -- A new prefix: the replica that least recently took one, so every cache gets used.
  local oldest, pick = math.huge, {}
  for _, c in ipairs(near) do
    local turn = tonumber(redis.call('HGET', rotation_key, c.name) or '0')
    if turn < oldest then oldest = turn; pick = {c} elseif turn == oldest then pick[#pick + 1] = c end
  end
  chosen = pick[math.min(#pick, math.floor(rand * #pick) + 1)]
  reason = 'new_prefix'
elseif hinted then
  chosen = home(near)
else
  chosen = near[math.min(#near, math.floor(rand * #near) + 1)]
end
if best_cached == 0 then
  redis.call('HSET', rotation_key, chosen.name, redis.call('INCR', rotation_key .. ':turn'))
elseif chosen.cached >= best_cached then
  reason = 'cache_hit'
else
  reason = 'load_window'
end
if all_saturated then reason = 'all_saturated' end

local lease = KEYS[4 * chosen.index - 3]
local pend = KEYS[4 * chosen.index - 2]
local pred = KEYS[4 * chosen.index - 1]
local prio = KEYS[4 * chosen.index]
redis.call('ZADD', lease, now + lease_ms, request_id)
redis.call('HSET', pend, request_id, math.max(0, prompt_tokens - chosen.cached))
redis.call('HSET', prio, request_id, priority)
redis.call('PEXPIRE', lease, lease_ms * 2)
redis.call('PEXPIRE', pend, lease_ms * 2)
redis.call('PEXPIRE', prio, lease_ms * 2)
if pred_ttl_ms > 0 and #hashes > chosen.local_blocks then
  -- Blocks every gateway's exact index already holds for the chosen replica need no prediction.
  local expiry = now + pred_ttl_ms
  for k = chosen.local_blocks + 1, #hashes, 500 do
    local args = {}
    for j = k, math.min(k + 499, #hashes) do
      args[#args + 1] = expiry
      args[#args + 1] = hashes[j]
    end
    redis.call('ZADD', pred, unpack(args))
  end
  redis.call('PEXPIRE', pred, pred_ttl_ms * 2)
end
return explain(chosen.name, reason)
"""

# Fixed one-minute windows: KEYS[1] request counter, KEYS[2] token counter; ARGV[1] tokens,
# ARGV[2] window ms. Returns {requests, tokens} in the current window after counting this one.
COUNT_USAGE = r"""
local requests = redis.call('INCR', KEYS[1])
local tokens = redis.call('INCRBY', KEYS[2], tonumber(ARGV[1]))
if requests == 1 then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
end
return {requests, tokens}
"""
