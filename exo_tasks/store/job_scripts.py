"""The Lua scripts that create a job and move it between statuses. Each checks first (the
queue's room, the client's quota, the job's current status and owner) and writes after, in one
step, so that whoever ends a job first wins and a job never ends twice."""

from __future__ import annotations

from exo_tasks.store.client import NAMED_ARGS

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


# KEYS: job hash, event stream, endings stream, active jobs. Arguments (NAMED_ARGS): `status`,
# the new one; `record`; `event`, its name ('' for none), and `data`; `ttl`, seconds (each key's
# expiry starts again); `only_owner`, the owner the job must still have ('' for any); `owner`,
# the new one; `job_id`; `allowed_from`, the statuses the job may move from (`one_set`);
# `counts`, the metrics' increments that come with the move (metrics.Observations.as_argument):
# with it, so a job read as ended is counted, and counted once. The only events a transition
# appends end an attempt (done, error, requeued): they go to the endings stream too, which the
# task waiting for the attempt reads without waking for every token. An ending (done, error)
# leaves the active jobs.
TRANSITION = (
    NAMED_ARGS
    + f"""
local current = redis.call('HGET', KEYS[1], 'status')
if not one_of(current, a.allowed_from) then return 0 end
if a.only_owner ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= a.only_owner then return 0 end
{leave_waiting("a.status", "a.job_id")}
redis.call('HSET', KEYS[1], 'status', a.status, 'record', a.record, 'owner', a.owner)
if a.event ~= '' then
  redis.call('XADD', KEYS[2], '*', 'event', a.event, 'data', a.data)
  redis.call('XADD', KEYS[3], '*', 'event', a.event, 'data', a.data)
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], a.ttl) end
if a.event == 'done' or a.event == 'error' then redis.call('SREM', KEYS[4], a.job_id) end
for key, field, amount in string.gmatch(a.counts, '([^\\t\\n]+)\\t([^\\t\\n]+)\\t([^\\t\\n]+)') do
  redis.call('HINCRBYFLOAT', key, field, amount)
end
return 1
"""
)

# KEYS: job hash, recent jobs, active jobs, then the client's sets of waiting jobs (`sets` of
# them: none, or its set for the job's priority class first, then the other classes'), then the
# queue's lists. Arguments (NAMED_ARGS): `max_queued`, the most messages allowed in the queue;
# `status`; `record`; `created_at`; `job_id`; `ttl`, seconds; `queue`; `sets`; `quota`, the most
# jobs the client may have waiting; `oldest`, the oldest creation time a waiting job can have
# (an older one's record has expired); `steps`, the job's step by the number of its client's
# jobs waiting in its class (fairness.step_table, as words). Creates the job unless the queue
# is full or the client has its quota waiting. Returns the messages in the queue, the client's
# waiting jobs, and the job's step (-1: not created).
CREATE_UNLESS_FULL = (
    NAMED_ARGS
    + f"""
local sets = tonumber(a.sets)
local depth = 0
for i = 4 + sets, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
local mine, ahead = 0, 0
for i = 4, 3 + sets do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. a.oldest)
  local n = redis.call('ZCARD', KEYS[i])
  mine = mine + n
  if i == 4 then ahead = n end
end
if depth >= tonumber(a.max_queued) or (sets > 0 and mine >= tonumber(a.quota)) then
  return {{depth, mine, -1}}
end
local steps = {{}}
for step in string.gmatch(a.steps, '%S+') do table.insert(steps, step) end
local step = steps[1 + math.min(ahead, #steps - 1)]
redis.call('HSET', KEYS[1], 'status', a.status, 'record', a.record, 'queue', a.queue)
redis.call('HSET', KEYS[1], 'priority', step)
if sets > 0 then
  redis.call('HSET', KEYS[1], 'client', KEYS[4])
  redis.call('ZADD', KEYS[4], a.created_at, a.job_id)
  redis.call('EXPIRE', KEYS[4], a.ttl)
end
redis.call('EXPIRE', KEYS[1], a.ttl)
redis.call('SADD', KEYS[3], a.job_id)
redis.call('ZADD', KEYS[2], a.created_at, a.job_id)
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -{RECENT_JOBS_KEPT + 1})
return {{depth, mine, tonumber(step)}}
"""
)
