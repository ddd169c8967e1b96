-- release: end jobs' holds on active-type keys (compare-and-delete), many at once.
--
-- KEYS: the active-type keys
-- ARGV[4i - 3]: job id that must still hold KEYS[i]
-- ARGV[4i - 2]: keep ms for KEYS[i]: "0" delete now; "" keep (finished) with no expiry;
--               n keep n ms; "-" keep as it is (the job goes on), only end the run;
--               "+" only mark the run (it started); "^" mark the run as handing the
--               job over to a replacement ("^" .. run); "v" undo "^" (nothing was sent)
-- ARGV[4i - 1]: the delivery whose run ended ("" the message never ran); a key that
--           another delivery of the job is running under, or that this delivery
--           handed over, is left alone
-- ARGV[4i]: the dispatch (generation) whose hold ends ("" any): a key a later dispatch
--           of the same job id created is left alone
-- Returns: one string, a character per key: "1" if the key was held by the job and
--   changed, else "0".

local changed = {}
for i, key in ipairs(KEYS) do
  local job, keep, run = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1]
  local r = decode(redis.call("GET", key))
  local done = "0"
  local mine = r and r.job == job and r.kind ~= "w" and same_generation(r, ARGV[4 * i])
  local handed = mine and string.sub(r.run, 1, 1) == "^"
  if keep == "^" or keep == "v" then
    local from, to = run, "^" .. run
    if keep == "v" then from, to = to, from end
    if mine and r.run == from and run ~= "" then
      r.run = to
      redis.call("SET", key, encode(r), "KEEPTTL")
      done = "1"
    end
  elseif keep == "+" then
    if mine and r.finished ~= "1" and r.run ~= run and r.run ~= "^" .. run
        and not run_alive(r, now_ms()) then
      r.run, r.alive = run, ""
      redis.call("SET", key, encode(r), "KEEPTTL")
      done = "1"
    end
  elseif mine and run_may_end(r, run) then
    if keep == "-" then
      if r.run ~= "" then
        r.run, r.alive = "", ""
        redis.call("SET", key, encode(r), "KEEPTTL")
        done = "1"
      end
    elseif keep == "0" then
      redis.call("DEL", key)
      done = "1"
    elseif r.finished ~= "1" then
      -- A repeated final release must not push retention further.
      r.finished = "1"
      r.run, r.alive = "", ""
      put(key, encode(r), keep)
      done = "1"
    end
  end
  changed[i] = done
end
return table.concat(changed)
