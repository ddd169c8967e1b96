-- decide: resolve a batch of dispatch claims in order, atomically.
--
-- KEYS: every distinct storage key the batch names (one hash slot).
-- ARGV[1]: "1" all-or-nothing (any conflict: write nothing), "0" otherwise
-- ARGV[2]: number of claims N; then 14 fields per claim:
--   job_id, task,
--   active key index into KEYS (0: none), scope char (q|a|e) then the dispatch's
--   generation (kept in the active key's fp field), lease ms ("" none),
--   window key index (0: none), window ms, fingerprint, policy,
--   handoff_from ("" none),
--   on duplicate ("" reuse | "l" latest | "d" debounce), encoded arguments,
--   debounce ms, debounce max ms ("" none)
-- Then, only where the store shares its Redis server with a Redis broker:
-- broker db, store db, and one triple per message, in publishing order: the
-- claim it goes with (its position, from 1; 0: a job without uniqueness),
-- queue key, message. A message is pushed to the broker's queue in this same
-- script when its claim was created (and, in an all-or-nothing batch, only if
-- no claim failed), before any key is written; the queues of several pushes
-- are checked to be lists first, so a refused push writes nothing: no
-- reservation without its message, and no message without its reservation.
-- Returns: one string, a result per claim decided, results joined by 0x1E, each
--   result's fields joined by 0x1F: verdict, job_id, drift "1"|"0", then
--   conflicting ids... for a conflict; else effect ("" none | "arguments_replaced"
--   | "postponed" | "rerun_requested"), the planned start ("" none): ms since the
--   epoch, the server's clock.
--   verdict: "created" | "reused_active" | "reused_window"
--            | "conflict" | "composition_conflict"
--   (One bulk string instead of nested arrays: a client parses it in one step,
--   which matters for a batch of a thousand.)

local all_or_nothing = ARGV[1] == "1"
local since_ms = nil
-- The server's clock, read once per batch and only by a batch that writes a record.
local function since()
  if not since_ms then since_ms = now_ms() end
  return since_ms
end
local count = tonumber(ARGV[2])
local overlay = {}   -- key -> record as this batch read or wrote it, or false (none);
                     -- a record's text until a claim needs more than its job
local writes = {}    -- ordered {key, record, ttl}
local results = {}
local failed = false

local function read(key)
  local r = overlay[key]
  if r == nil then
    r = redis.call("GET", key) or false
    overlay[key] = r
  end
  if type(r) == "string" then
    r = decode(r)
    overlay[key] = r
  end
  return r or nil
end

-- The job holding key, for a claim that needs no other field of its record: decoding
-- the whole record costs a reused dispatch more than the rest of its decision. The
-- record's text is kept, for a later claim of the batch that needs all of it. Its first
-- lines are read's on purpose: a helper for both is one more closure in every call of
-- the script, about 2,500 instructions (bench/script_cost.py), created dispatches too.
local function holder_of(key)
  local r = overlay[key]
  if r == nil then
    r = redis.call("GET", key) or false
    overlay[key] = r
  end
  if type(r) == "string" then return string.match(r, JOB) end
  return r and r.job or nil
end

local function write(key, record, ttl)
  overlay[key] = record
  writes[#writes + 1] = {key, record, ttl}
end

for i = 0, count - 1 do
  local base = 3 + i * 14
  local job, task = ARGV[base], ARGV[base + 1]
  local aindex, windex = ARGV[base + 2], ARGV[base + 5]
  local akey = aindex ~= "0" and KEYS[tonumber(aindex)] or nil
  local scope, lease = string.sub(ARGV[base + 3], 1, 1), ARGV[base + 4]
  local wkey = windex ~= "0" and KEYS[tonumber(windex)] or nil
  local window_ms, fp, policy, handoff = ARGV[base + 6], ARGV[base + 7], ARGV[base + 8], ARGV[base + 9]
  local follow, args = ARGV[base + 10], ARGV[base + 11]
  local debounce, debounce_max = ARGV[base + 12], ARGV[base + 13]

  -- A claim with an active key alone, reusing its holder as is, needs only the holder.
  local held, holder
  if wkey or follow ~= "" or handoff ~= "" then
    held = akey and read(akey) or nil
    holder = held and held.job or nil
  else
    holder = akey and holder_of(akey) or nil
    held = holder and true or nil
  end
  local remembered = wkey and read(wkey) or nil
  local hands_off = held and handoff ~= "" and holder == handoff and held.finished ~= "1"
  local result

  if remembered then
    if remembered.fp ~= fp then
      result = {"conflict", remembered.job, "0", remembered.job}
    elseif holder and holder ~= remembered.job then
      result = {"composition_conflict", remembered.job, "0", remembered.job, holder}
    else
      result = {"reused_window", remembered.job, remembered.policy ~= policy and "1" or "0"}
    end
  else
    local pending = {}
    if wkey then
      local target = job
      if holder and holder ~= job and not hands_off then target = holder end
      pending[#pending + 1] = {wkey, {kind = "w", finished = "0", job = target, task = task,
                                      fp = fp, policy = policy, since = since()}, window_ms}
    end
    if held and not hands_off then
      result = {"reused_active", holder, "0", "", ""}
      -- latest/debounce: an unfinished active/exists hold of the same task follows it.
      if follow ~= "" and held.follows ~= "" and held.kind ~= "q" and held.kind ~= "w"
          and held.finished ~= "1" and held.task == task then
        local ttl = "keep"
        if held.run ~= "" or carries_owed(held) then
          -- It runs (or took over a run owed after the job that handed it the key):
          -- one run is owed after it, under the first asking duplicate's id.
          if held.owed == "" then held.owed = job end
          held.args = args
          result[4] = "rerun_requested"
        elseif follow == "d" and debounce ~= "" and held.follows == "d" then
          -- Never earlier than a start planned before: the message may not be received
          -- sooner (its countdown), and every receipt names a start that holds.
          local due = math.max(tonumber(since()) + tonumber(debounce), tonumber(held.due) or 0)
          if held.cap ~= "" then
            -- Capped: the lease its creation set covers the latest start already, and
            -- a stream of duplicates must not keep the key of a lost job alive.
            due = math.min(due, tonumber(held.cap))
          else
            local left = redis.call("PTTL", akey)
            if lease ~= "" and left >= 0 and left < tonumber(lease) then ttl = lease end
          end
          held.args, held.due = args, tostring(due)
          result[4], result[5] = "postponed", held.due
        else
          held.args = args
          result[4] = "arguments_replaced"
        end
        pending[#pending + 1] = {akey, held, ttl}
      end
    else
      result = {"created", job, "0", "", ""}
      if akey then
        local record = {kind = scope, finished = "0", job = job, task = task,
                        fp = string.sub(ARGV[base + 3], 2),
                        policy = "", since = since(), run = "", from = hands_off and holder or "",
                        follows = follow, owed = "", args = "", due = "", cap = ""}
        if hands_off and follow ~= "" and held.owed ~= "" then
          -- The running job hands its key to its successor: the run its duplicates are
          -- owed goes with the key, to follow the successor's run.
          record.owed, record.args = held.owed, held.args
        end
        if follow == "d" and debounce ~= "" then
          local now = tonumber(since())
          local due = now + tonumber(debounce)
          record.due = tostring(due)
          if debounce_max ~= "" then
            -- Never before the first planned start (a countdown longer than the cap).
            record.cap = tostring(math.max(now + tonumber(debounce_max), due))
          end
          result[5] = record.due
        end
        pending[#pending + 1] = {akey, record, lease}
      end
    end
    for _, w in ipairs(pending) do write(w[1], w[2], w[3]) end
  end

  results[#results + 1] = table.concat(result, US)
  if result[1] == "conflict" or result[1] == "composition_conflict" then
    failed = true
    if all_or_nothing then break end
  end
end

local enqueue = 3 + count * 14
if ARGV[enqueue] and not (failed and all_or_nothing) then
  local pushes = {}
  for at = enqueue + 2, #ARGV, 3 do
    local claim = tonumber(ARGV[at])
    if claim == 0 or string.sub(results[claim] or "", 1, 7) == "created" then
      pushes[#pushes + 1] = at
    end
  end
  if #pushes > 0 then
    redis.call("SELECT", ARGV[enqueue])
    -- One push that is refused refuses the script before it wrote anything; a later
    -- push refused would leave the earlier ones without their keys.
    local checked = {}
    for _, at in ipairs(#pushes > 1 and pushes or {}) do
      local queue = ARGV[at + 1]
      if not checked[queue] then
        local kind = redis.call("TYPE", queue).ok
        if kind ~= "list" and kind ~= "none" then
          redis.call("SELECT", ARGV[enqueue + 1])
          return redis.error_reply("WRONGTYPE queue " .. queue .. " is not a list")
        end
        checked[queue] = true
      end
    end
    for _, at in ipairs(pushes) do redis.call("LPUSH", ARGV[at + 1], ARGV[at + 2]) end
    redis.call("SELECT", ARGV[enqueue + 1])
  end
end

if not (failed and all_or_nothing) then
  for _, w in ipairs(writes) do
    if w[3] == "keep" then
      redis.call("SET", w[1], encode(w[2]), "KEEPTTL")
    else
      put(w[1], encode(w[2]), w[3])
    end
  end
end
return table.concat(results, "\30")
