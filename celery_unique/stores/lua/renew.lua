-- renew: push the lease of unfinished active-type keys a job still holds.
--
-- KEYS: active-type keys
-- ARGV[1]: job id
-- ARGV[2]: lease ms; a key's TTL becomes at least this
-- Returns: number of keys renewed.

local renewed = 0
local lease = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  local r = decode(redis.call("GET", key))
  if r and r.job == ARGV[1] and r.kind ~= "w" and r.finished ~= "1" then
    local ttl = redis.call("PTTL", key)
    if ttl >= 0 and ttl < lease then
      redis.call("PEXPIRE", key, lease)
      renewed = renewed + 1
    end
  end
end
return renewed
