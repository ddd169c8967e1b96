-- forget: delete a key for an operator, optionally only while a job holds it.
--
-- KEYS[1]: the key
-- ARGV[1]: job id that must hold it ("" any)
-- Returns: 1 if deleted, else 0.

local r = decode(redis.call("GET", KEYS[1]))
if not r or (ARGV[1] ~= "" and r.job ~= ARGV[1]) then return 0 end
redis.call("DEL", KEYS[1])
return 1
