-- pass_on: hand a finished job's active key to the run its duplicates are owed.
--
-- KEYS[1]: the active-type key
-- ARGV[1]: the job whose run ended for good; ARGV[2]: that delivery's run id ("" none);
-- ARGV[3]: lease ms for the owed job ("" none)
-- Returns: "" when no run is owed (or the key is not the job's, or another delivery
--   of it runs); else the owed job's id, 0x1F, the task that wrote the key ("" when
--   the key names it), 0x1F, the latest duplicate's arguments.
--   Asked again by the same delivery once the key moved, it names the same job;
--   another delivery of the job (a copy delivered again) gets "".

local key, job, run, lease = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local r = decode(redis.call("GET", key))
if not r or r.kind == "w" then return "" end
local passed = "<" .. job .. "\30" .. run
if r.owed == passed then return r.job .. US .. r.task .. US .. r.args end
local owed = owed_run(r.owed)
if r.job ~= job or r.finished == "1" or owed == "" or not run_may_end(r, run) then
  return ""
end
r.job, r.owed, r.run, r.from, r.due, r.since = owed, passed, "", "", "", now_ms()
r.alive = ""
put(key, encode(r), lease)
return owed .. US .. r.task .. US .. r.args
