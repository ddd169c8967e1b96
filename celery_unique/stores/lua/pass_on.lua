-- pass_on: hand a finished job's active key to the run its duplicates are owed; or, asked
-- to end the hold, release the key in the same step when none is owed.
--
-- KEYS[1]: the active-type key
-- ARGV[1]: the job whose run ended for good; ARGV[2]: that delivery's run id ("" none);
-- ARGV[3]: lease ms for the owed job ("" none)
-- ARGV[4]: "1" to end the hold when no run is owed, as release.lua's finished keeps do
--   with ARGV[5]: "0" delete; "" keep (finished) with no expiry; n keep n ms
-- Returns: "" when no run is owed (or the key is not the job's, or another delivery
--   of it runs); "\30" when the hold was ended; else the owed job's id, 0x1F, the task
--   that wrote the key ("" when the key names it), 0x1F, the latest duplicate's arguments.
--   Asked again by the same delivery once the key moved, it names the same job;
--   another delivery of the job (a copy delivered again) gets "".

local key, job, run, lease = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local ending, keep = ARGV[4] == "1", ARGV[5]
local r = decode(redis.call("GET", key))
if not r or r.kind == "w" then return "" end
local passed = job .. "\30" .. run
if r.passed == passed then return r.job .. US .. r.task .. US .. r.args end
if r.job ~= job or r.finished == "1" or not run_may_end(r, run) then return "" end
local owed = r.owed
if owed == "" then
  if not ending then return "" end
  if keep == "0" then
    redis.call("DEL", key)
  else
    r.finished, r.run, r.alive = "1", "", ""
    put(key, encode(r), keep)
  end
  return "\30"
end
r.job, r.owed, r.passed, r.run, r.from, r.due, r.since = owed, "", passed, "", "", "", now_ms()
r.alive = ""
put(key, encode(r), lease)
return owed .. US .. r.task .. US .. r.args
