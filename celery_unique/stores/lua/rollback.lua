-- rollback: undo created claims (their publish failed, or the decision's reply was lost).
--
-- KEYS: every claim's keys, claim after claim (a claim's active key first)
-- ARGV[1]: number of claims N; then 5 fields per claim:
--   job id, handoff_from (the running job to give the active key back to; "" none),
--   "1" when the claim's first key is its active key, number of keys of the claim,
--   the claim's generation ("" none)
-- Returns: number of keys changed.
--
-- Only keys still pointing at the claim's job change, so undoing a claim that was
-- never applied, or undoing one twice, changes nothing. A claim with a generation
-- undoes only the active key its own decision wrote: the same job id may hold the
-- key by another way since (a later dispatch of a caller's id; the run a running
-- job owed its duplicates, named after the duplicate whose decision is undone).

local changed, k = 0, 1
for c = 0, tonumber(ARGV[1]) - 1 do
  local base = 2 + c * 5
  local job, handoff, has_active = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  local gen = ARGV[base + 4]
  for i = 1, tonumber(ARGV[base + 3]) do
    local key = KEYS[k]
    local r = decode(redis.call("GET", key))
    local active = i == 1 and has_active == "1"
    if r and r.job == job and not (active and gen ~= "" and r.fp ~= gen) then
      if active and handoff ~= "" then
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
