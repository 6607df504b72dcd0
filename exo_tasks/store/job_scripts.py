"""The Lua scripts that create a job and move it between statuses. Each checks first (the
queue's room, the client's quota, the job's current status and owner) and writes after, in one
step, so that whoever ends a job first wins and a job never ends twice."""

from __future__ import annotations

RECENT_JOBS_KEPT = 10_000


def leave_waiting(new_status: str, job_id: str) -> str:
    """Lua for a script that moves the job of hash KEYS[1] from status `current` to
    `new_status`: a job that leaves `queued` leaves its client's waiting jobs (exo_tasks.fairness),
    a set its hash names. A key outside KEYS: the store's scripts already touch a job's and a
    queue's keys together, so it runs on one Redis, never a cluster."""
    return f"""
if current == 'queued' and {new_status} ~= 'queued' then
  local waiting = redis.call('HGET', KEYS[1], 'client')
  if waiting then redis.call('ZREM', waiting, {job_id}) end
end
"""


# KEYS: job hash, event stream, endings stream, active jobs. ARGV: new status, record, event
# name ('' for none), event data, ttl seconds (each key's expiry starts again), the owner the
# job must still have ('' for any), the new owner, the job id, then the statuses the job may
# move from. The only events a transition appends end an attempt (done, error, requeued): they
# go to the endings stream too, which the task waiting for the attempt reads without waking for
# every token. An ending (done, error) leaves the active jobs.
TRANSITION = f"""
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = false
for i = 9, #ARGV do
  if current == ARGV[i] then allowed = true end
end
if not allowed then return 0 end
if ARGV[6] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[6] then return 0 end
{leave_waiting("ARGV[1]", "ARGV[8]")}
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2], 'owner', ARGV[7])
if ARGV[3] ~= '' then
  redis.call('XADD', KEYS[2], '*', 'event', ARGV[3], 'data', ARGV[4])
  redis.call('XADD', KEYS[3], '*', 'event', ARGV[3], 'data', ARGV[4])
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
if ARGV[3] == 'done' or ARGV[3] == 'error' then redis.call('SREM', KEYS[4], ARGV[8]) end
return 1
"""

# KEYS: job hash, recent jobs, active jobs, then the client's sets of waiting jobs (ARGV[8] of
# them: none, or its set for the job's priority class first, then the other classes'), then the
# queue's lists. ARGV: the most messages allowed in the queue, status, record, created_at, job
# id, ttl seconds, queue, the number of client sets, the most jobs the client may have waiting,
# the oldest creation time a waiting job can have (an older one's record has expired), then the
# job's step by the number of its client's jobs waiting in its class (fairness.step_table).
# Creates the job unless the queue is full or the client has its quota waiting. Returns the
# messages in the queue, the client's waiting jobs, and the job's step (-1: not created).
CREATE_UNLESS_FULL = f"""
local sets = tonumber(ARGV[8])
local depth = 0
for i = 4 + sets, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
local mine, ahead = 0, 0
for i = 4, 3 + sets do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[10])
  local n = redis.call('ZCARD', KEYS[i])
  mine = mine + n
  if i == 4 then ahead = n end
end
if depth >= tonumber(ARGV[1]) or (sets > 0 and mine >= tonumber(ARGV[9])) then
  return {{depth, mine, -1}}
end
local step = ARGV[11 + math.min(ahead, #ARGV - 11)]
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'record', ARGV[3], 'queue', ARGV[7])
redis.call('HSET', KEYS[1], 'priority', step)
if sets > 0 then
  redis.call('HSET', KEYS[1], 'client', KEYS[4])
  redis.call('ZADD', KEYS[4], ARGV[4], ARGV[5])
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('SADD', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -{RECENT_JOBS_KEPT + 1})
return {{depth, mine, tonumber(step)}}
"""
