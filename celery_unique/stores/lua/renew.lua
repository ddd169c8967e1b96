-- renew: push the lease of unfinished active-type keys their jobs still hold.
--
-- KEYS: active-type keys
-- ARGV[1]: lease ms; a key's TTL becomes at least this
-- ARGV[1 + i]: the job id that must hold KEYS[i]
-- Returns: number of keys renewed.

local renewed = 0
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local r = decode(redis.call("GET", key))
  if r and r.job == ARGV[1 + i] and r.kind ~= "w" and r.finished ~= "1" then
    local ttl = redis.call("PTTL", key)
    if ttl >= 0 and ttl < lease then
      redis.call("PEXPIRE", key, lease)
      renewed = renewed + 1
    end
  end
end
return renewed
