-- Shared by every celery-unique script (prepended when the script is loaded).
--
-- Key layout. Every key of one namespace shares the hash tag "{namespace}",
-- so all keys a script touches live in one Redis Cluster slot.
--   <prefix>:v1:{ns}:a:<scope><US><key>   active-type key (string)
--   <prefix>:v1:{ns}:w:<scope><US><key>   window key      (string)
-- (<US> is the 0x1F unit separator; <scope> is a task name or empty.)
--
-- Value: sixteen fields joined by 0x1F (values written by earlier versions have
-- fewer, and read with the missing ones empty):
--   kind      "q" | "a" | "e" (active key held for scope queued/active/exists) or "w" (window)
--   finished  "1" once an exists-scope job has finished and the key only waits out retention
--   job_id    the job the key points at
--   task      the task name of the dispatch that wrote the key; "" when the key is
--             scoped to that task already (the name is in the key)
--   fp        window keys: request fingerprint digest; active keys: the generation
--             (the dispatch that created the hold; "" unknown)
--   policy    window keys: retry/time-limit settings digest; else ""
--   since     when a decision wrote the key: ms since the epoch, the server's clock
--   run       active keys: the delivery of the job running now; "" when none is
--   from      active keys: the running job that handed the key over to this one; ""
--   follows   active keys: "l" | "d" when the job's dispatch chose latest | debounce,
--             so that its duplicates change it; ""
--   owed      active keys (latest/debounce): the job owed a run once this one ends
--             (a caller's job id, nothing else); ""
--   args      active keys (latest/debounce): the latest duplicate's arguments
--             (encoded by the client, base64: never a 0x1F); ""
--   due       active keys (debounce): the planned start, ms since the epoch; ""
--   cap       active keys (debounce): the latest planned start allowed; ""
--   alive     active keys: until when `run` is vouched alive by its worker (its
--             start, its renewals), ms since the epoch; ""
--   passed    active keys (latest/debounce): j .. "\30" .. r once the delivery r of
--             the ended job j passed the key on to this one, until it starts (a job
--             id holds no control character); ""
-- Expiry is the key's own TTL, so time is always the server's clock.

local US = "\31"

-- One match for all sixteen fields (a missing trailing field matches as ""): splitting
-- field by field costs more Lua time than the rest of a decision.
local RECORD = "^([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)\31?([^\31]*)"

-- A record's job field alone (RECORD's third capture).
local JOB = "^[^\31]*\31?[^\31]*\31?([^\31]*)"

local function decode(value)
  if not value then return nil end
  local kind, finished, job, task, fp, policy, since, run, from, follows, owed, args, due,
        cap, alive, passed = string.match(value, RECORD)
  return {kind = kind, finished = finished, job = job, task = task, fp = fp, policy = policy,
          since = since, run = run, from = from, follows = follows, owed = owed, args = args,
          due = due, cap = cap, alive = alive, passed = passed}
end

local function encode(r)
  -- Concatenations of many operands, each one copy: tables and table.concat cost more.
  local head = r.kind .. US .. r.finished .. US .. r.job .. US .. r.task .. US .. r.fp .. US
    .. r.policy .. US .. (r.since or "") .. US .. (r.run or "") .. US .. (r.from or "")
  local follows, owed, args = r.follows or "", r.owed or "", r.args or ""
  local due, cap, alive, passed = r.due or "", r.cap or "", r.alive or "", r.passed or ""
  -- Trailing empty fields are left out: most keys stay nine fields.
  if passed ~= "" then
    return head .. US .. follows .. US .. owed .. US .. args .. US .. due .. US .. cap .. US
      .. alive .. US .. passed
  elseif alive ~= "" then
    return head .. US .. follows .. US .. owed .. US .. args .. US .. due .. US .. cap .. US .. alive
  elseif cap ~= "" then
    return head .. US .. follows .. US .. owed .. US .. args .. US .. due .. US .. cap
  elseif due ~= "" then
    return head .. US .. follows .. US .. owed .. US .. args .. US .. due
  elseif args ~= "" then
    return head .. US .. follows .. US .. owed .. US .. args
  elseif owed ~= "" then
    return head .. US .. follows .. US .. owed
  elseif follows ~= "" then
    return head .. US .. follows
  end
  return head
end

-- Whether the run r owes came with the key from the running job that handed it over
-- (self-rescheduling): it follows this job's run, which keeps its own arguments.
local function carries_owed(r)
  return r.owed ~= "" and r.from ~= ""
end

-- Whether an operator's release of r would lose what the job's duplicates left it: the
-- run owed to them, or their arguments, which the job's next run (the first, or one
-- after a retry or a requeue) starts with.
local function owes_duplicates(r)
  return r.kind ~= "w" and r.finished ~= "1" and (r.follows or "") ~= ""
    and (r.owed ~= "" or r.args ~= "")
end

-- Whether a delivery of the job that its worker still vouches alive marks r (not
-- one that handed the job over).
local function run_alive(r, now)
  return r.run ~= "" and string.sub(r.run, 1, 1) ~= "^" and r.alive ~= ""
    and tonumber(r.alive) > tonumber(now)
end

-- The server's clock in ms since the epoch.
local function now_ms()
  local t = redis.call("TIME")
  -- Seconds, then the first three of the six microsecond digits: writing a 13-digit
  -- number as text costs Lua more than building it from the digits.
  return t[1] .. string.sub("00000" .. t[2], -6, -4)
end

-- Whether the end of delivery `run` may end the hold r: no other delivery of the job
-- runs, and `run` did not hand the job over to a replacement ("^" .. run). A mark
-- whose worker stopped vouching for it is a run that ended or died: its own release
-- may never come (a worker that lost its broker connection can lose track of a run
-- its pool went on with), so it does not keep the key from the job's other deliveries.
local function run_may_end(r, run)
  if r.run == "" or r.run == run then return true end
  if string.sub(r.run, 1, 1) == "^" then return r.run ~= "^" .. run end
  return r.alive ~= "" and tonumber(r.alive) <= tonumber(now_ms())
end

-- Whether a release naming generation gen may end r's hold (either unknown: a key or a
-- header written by an earlier version).
local function same_generation(r, gen)
  return gen == nil or gen == "" or r.fp == "" or r.fp == gen
end

-- Write a record with a TTL in ms ("" or nil: no expiry).
local function put(key, value, ttl)
  if ttl and ttl ~= "" then
    redis.call("SET", key, value, "PX", ttl)
  else
    redis.call("SET", key, value)
  end
end
