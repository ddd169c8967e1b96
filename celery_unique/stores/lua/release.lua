-- release: end jobs' holds on active-type keys (compare-and-delete), many at once.
--
-- KEYS: the active-type keys
-- ARGV[2i - 1]: job id that must still hold KEYS[i]
-- ARGV[2i]: keep ms for KEYS[i]: "0" delete now; "" keep (finished) with no expiry;
--           n keep n ms
-- Returns: one string, a character per key: "1" if the key was held by the job and
--   changed, else "0".

local changed = {}
for i, key in ipairs(KEYS) do
  local job, keep = ARGV[2 * i - 1], ARGV[2 * i]
  local r = decode(redis.call("GET", key))
  local done = "0"
  if r and r.job == job and r.kind ~= "w" then
    if keep == "0" then
      redis.call("DEL", key)
      done = "1"
    elseif r.finished ~= "1" then
      -- A repeated final release must not push retention further.
      r.finished = "1"
      put(key, encode(r), keep)
      done = "1"
    end
  end
  changed[i] = done
end
return table.concat(changed)
