-- rollback: undo created claims (their publish failed, or the decision's reply was lost).
--
-- KEYS: every claim's keys, claim after claim (a claim's active key first)
-- ARGV[1]: number of claims N; then 4 fields per claim:
--   job id, handoff_from (the running job to give the active key back to; "" none),
--   "1" when the claim's first key is its active key, number of keys of the claim
-- Returns: number of keys changed.
--
-- Only keys still pointing at the claim's job change, so undoing a claim that was
-- never applied, or undoing one twice, changes nothing.

local changed, k = 0, 1
for c = 0, tonumber(ARGV[1]) - 1 do
  local base = 2 + c * 4
  local job, handoff, has_active = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  for i = 1, tonumber(ARGV[base + 3]) do
    local key = KEYS[k]
    local r = decode(redis.call("GET", key))
    if r and r.job == job then
      if i == 1 and has_active == "1" and handoff ~= "" then
        r.job = handoff
        redis.call("SET", key, encode(r), "KEEPTTL")
      else
        redis.call("DEL", key)
      end
      changed = changed + 1
    end
    k = k + 1
  end
end
return changed
