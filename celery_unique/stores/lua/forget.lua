-- forget: delete a key for an operator, optionally only while a job holds it.
--
-- KEYS[1]: the key; KEYS[2] (with a job id): the job's release note (keyspace.release_note)
-- ARGV[1]: job id that must hold it ("" any)
-- ARGV[2]: "1" to spare a hold whose job follows its duplicates (latest/debounce) and
--   owes them a run, or holds their arguments (its next run starts with them)
-- Returns: 1 if deleted, 2 if spared (nothing written), else 0.
--
-- An operator's release never drops the job: the note, kept as long as the hold would
-- have been, lets the job's deliveries run once another job holds the key (start.lua).
-- It holds the dispatch's generation.

local r = decode(redis.call("GET", KEYS[1]))
if not r or (ARGV[1] ~= "" and r.job ~= ARGV[1]) then return 0 end
if ARGV[2] == "1" and owes_duplicates(r) then return 2 end
if KEYS[2] and r.kind ~= "w" and r.finished ~= "1" then
  local ttl = redis.call("PTTL", KEYS[1])
  put(KEYS[2], r.fp, ttl > 0 and ttl or "")
end
redis.call("DEL", KEYS[1])
return 1
