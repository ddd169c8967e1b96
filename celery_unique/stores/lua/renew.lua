-- renew: push the lease of unfinished active-type keys their jobs still hold, and
-- vouch again for the runs that still mark them.
--
-- KEYS: active-type keys
-- ARGV[1]: lease ms, a key's TTL becomes at least this ("" none)
-- ARGV[2]: how long a run is vouched alive from now, ms ("" not at all)
-- ARGV[1 + 2i]: the job id that must hold KEYS[i]
-- ARGV[2 + 2i]: the delivery running it on the renewing worker ("" none)
-- Returns: number of keys renewed (lease pushed, or run vouched for).

local renewed = 0
local lease = tonumber(ARGV[1])
local alive = ""
if ARGV[2] ~= "" then alive = tostring(tonumber(now_ms()) + tonumber(ARGV[2])) end
for i, key in ipairs(KEYS) do
  local r = decode(redis.call("GET", key))
  if r and r.job == ARGV[1 + 2 * i] and r.kind ~= "w" and r.finished ~= "1" then
    local done = false
    local run = ARGV[2 + 2 * i]
    if alive ~= "" and run ~= "" and r.run == run then
      r.alive = alive
      redis.call("SET", key, encode(r), "KEEPTTL")
      done = true
    end
    local ttl = redis.call("PTTL", key)
    if lease and ttl >= 0 and ttl < lease then
      redis.call("PEXPIRE", key, lease)
      done = true
    end
    if done then renewed = renewed + 1 end
  end
end
return renewed
