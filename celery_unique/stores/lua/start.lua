-- start: mark an active-type key as held by a run of its job, before the run starts.
--
-- KEYS[1]: the active-type key
-- ARGV[1]: job id; ARGV[2]: the delivery's run id; ARGV[3]: scope char (a|e);
-- ARGV[4]: task name to store ("" when the key names it); ARGV[5]: lease ms ("" none)
-- Returns: "" when the run may go ahead (the key is the job's now), else the id of
--   the other job that holds the key (nothing written).

local key, job, run, scope, task, lease = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local r = decode(redis.call("GET", key))
if not r then
  -- Nobody holds it: the lease ran out, or another delivery of the job released it.
  put(key, encode({kind = scope, finished = "0", job = job, task = task, fp = "", policy = "",
                   since = now_ms(), run = run, from = ""}), lease)
  return ""
end
if r.job ~= job then
  if r.from == job then return "" end  -- handed over by this job while it ran
  return r.job
end
local ttl = redis.call("PTTL", key)
r.run = run
if r.finished == "1" then
  r.finished = "0"
  put(key, encode(r), lease)
elseif lease ~= "" and ttl >= 0 and ttl < tonumber(lease) then
  put(key, encode(r), lease)
else
  redis.call("SET", key, encode(r), "KEEPTTL")
end
return ""
