-- start: mark an active-type key as held by a run of its job, before the run starts.
--
-- KEYS[1]: the active-type key; KEYS[2]: the job's release note (keyspace.release_note)
-- ARGV[1]: job id; ARGV[2]: the delivery's run id; ARGV[3]: scope char (a|e);
-- ARGV[4]: task name to store ("" when the key names it); ARGV[5]: lease ms ("" none);
-- ARGV[6]: "1" when the job follows its duplicates (latest/debounce)
-- ARGV[7]: how long this start vouches that the run is alive, ms ("" not at all)
-- ARGV[8]: the dispatch (generation) the delivery carries ("" unknown)
-- Returns: "" when the run may go ahead (the key is the job's now), else the id of
--   the other job that holds the key (nothing written). Or 0x1E "B" ms: another
--   delivery of the job runs, vouched alive ms longer (nothing written). A job that
--   follows its duplicates may get instead: 0x1E "W" ms: its planned start is ms
--   away (nothing written); 0x1E "A" arguments: go ahead, with the latest
--   duplicate's arguments.

local key, job, run, scope, task, lease = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local follows = ARGV[6] == "1"
local now = now_ms()
local alive = ""
if (ARGV[7] or "") ~= "" then alive = tostring(tonumber(now) + tonumber(ARGV[7])) end
local r = decode(redis.call("GET", key))
if not r then
  -- Nobody holds it: the lease ran out, or another delivery of the job released it.
  put(key, encode({kind = scope, finished = "0", job = job, task = task, fp = ARGV[8] or "",
                   policy = "",
                   since = now, run = run, from = "", alive = alive}), lease)
  return ""
end
if r.job ~= job then
  if r.from == job then return "" end  -- handed over by this job while it ran
  -- Released by an operator before this job took the key: the job still runs,
  -- beside the key's holder, unmarked. Else this is a copy of a job that ran already.
  local note = KEYS[2] and redis.call("GET", KEYS[2])
  if note and same_generation({fp = note}, ARGV[8]) then return "" end
  return r.job
end
if follows and r.due ~= "" then
  local wait = tonumber(r.due) - tonumber(now)
  if wait > 0 then return "\30W" .. tostring(wait) end
end
if r.run ~= run and run_alive(r, now) then
  -- Another delivery of the job runs, and its worker says it is alive: the broker
  -- delivered the message again although that run goes on.
  return "\30B" .. tostring(tonumber(r.alive) - tonumber(now))
end
local ttl = redis.call("PTTL", key)
r.run, r.due, r.alive, r.passed = run, "", alive, ""
-- A run that follows its duplicates starts with the latest arguments: a run owed by
-- an earlier duplicate is that run. Unless that run came with the key from the job
-- that handed it over: it follows this run, which keeps its own arguments.
local carried = carries_owed(r)
if follows and not carried then r.owed = "" end
if r.finished == "1" then
  r.finished = "0"
  put(key, encode(r), lease)
elseif lease ~= "" and ttl >= 0 and ttl < tonumber(lease) then
  put(key, encode(r), lease)
else
  redis.call("SET", key, encode(r), "KEEPTTL")
end
if follows and r.args ~= "" and not carried then return "\30A" .. r.args end
return ""
