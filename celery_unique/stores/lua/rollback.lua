-- rollback: undo a created claim after its publish failed.
--
-- KEYS: the claim's keys (active first when it has one)
-- ARGV[1]: the claim's job id
-- ARGV[2]: handoff_from: the running job to give the active key back to ("" none)
-- ARGV[3]: "1" when KEYS[1] is the active key
-- Returns: number of keys changed.

local changed = 0
for i, key in ipairs(KEYS) do
  local r = decode(redis.call("GET", key))
  if r and r.job == ARGV[1] then
    if i == 1 and ARGV[3] == "1" and ARGV[2] ~= "" then
      r.job = ARGV[2]
      redis.call("SET", key, encode(r), "KEEPTTL")
    else
      redis.call("DEL", key)
    end
    changed = changed + 1
  end
end
return changed
