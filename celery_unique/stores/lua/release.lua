-- release: end a job's hold on an active-type key (compare-and-delete).
--
-- KEYS[1]: the active-type key
-- ARGV[1]: job id that must still hold it
-- ARGV[2]: keep ms: "0" delete now; "" keep (finished) with no expiry; n keep n ms
-- Returns: 1 if the key was held by the job and changed, else 0.

local r = decode(redis.call("GET", KEYS[1]))
if not r or r.job ~= ARGV[1] or r.kind == "w" then return 0 end
if ARGV[2] == "0" then
  redis.call("DEL", KEYS[1])
  return 1
end
-- A repeated final signal must not push retention further.
if r.finished == "1" then return 0 end
r.finished = "1"
put(KEYS[1], encode(r), ARGV[2])
return 1
