"""The Redis Functions the broker calls: one Lua library, loaded by the learner at start.

Why functions: a function runs atomically and stops at its first failing command, so "add the
trajectory, then acknowledge its prompt" never acknowledges a prompt whose trajectory Redis
refused (MULTI/EXEC runs the rest of a transaction after a failed command), and "check the
learner's lease token, then write" cannot be split by another client's write.

What they do not do: confine a caller. Redis checks every command inside a function against the
calling user's ACL, so a generator calling a learner function fails at its first `HGET` of the
lease (NOPERM), and a function cannot stop a generator from sending XADD itself; confinement is by
keys (broker/connect/acl.py). Functions are run with FCALL only: the generators' ACL users hold no EVAL,
so they can run no Lua of their own (a busy loop in Lua would block every client).

Library: `rollflash_<digest>`, whose functions are named `rf_<digest>_<name>`: the digest is the
library's own sha256, so two versions of rollflash sharing a Redis never replace each other's
code, and loading is idempotent. Commands are named in KEYS (what ACLs check) or, for the lists
of commands `fenced` runs, in ARGV; this needs a standalone Redis (or Sentinel), not a cluster.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis

_LUA = r"""
local function lease_ok(lease, token)
  return redis.call('HGET', lease, 'token') == token
end

local function lost(lease)
  local h = redis.call('HMGET', lease, 'host', 'pid', 'since')
  return redis.error_reply('LEASELOST ' .. (h[1] or '-') .. ' ' .. (h[2] or '-') .. ' ' ..
    (h[3] or '-'))
end

local function holder(lease)
  local h = redis.call('HMGET', lease, 'host', 'pid', 'since')
  return {0, h[1] or '', h[2] or '', h[3] or ''}
end

-- KEYS lease; ARGV token ttl_ms host pid since take_over
local function lease_take(keys, args)
  if redis.call('EXISTS', keys[1]) == 1 and args[6] ~= '1' and
      not lease_ok(keys[1], args[1]) then
    return holder(keys[1])
  end
  redis.call('DEL', keys[1])
  redis.call('HSET', keys[1], 'token', args[1], 'host', args[3], 'pid', args[4],
    'since', args[5])
  redis.call('PEXPIRE', keys[1], args[2])
  return {1}
end

-- KEYS lease; ARGV token ttl_ms
local function lease_renew(keys, args)
  if not lease_ok(keys[1], args[1]) then return holder(keys[1]) end
  redis.call('PEXPIRE', keys[1], args[2])
  return {1}
end

-- KEYS lease; ARGV token
local function lease_release(keys, args)
  if lease_ok(keys[1], args[1]) then redis.call('DEL', keys[1]) end
  return 1
end

-- KEYS lease; ARGV host pid: free the lease of a holder its starter knows is dead
local function lease_release_dead(keys, args)
  local h = redis.call('HMGET', keys[1], 'host', 'pid')
  if h[1] == args[1] and h[2] == args[2] then
    redis.call('DEL', keys[1])
    return 1
  end
  return 0
end

-- KEYS lease; ARGV token, then commands as (n, arg1 .. argn) ...; returns their replies
local function fenced(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  local out, i = {}, 2
  while i <= #args do
    local n = tonumber(args[i])
    out[#out + 1] = redis.call(unpack(args, i + 1, i + n))
    i = i + n + 1
  end
  return out
end

local function xadd(stream, args, i, n)
  local id = redis.call('XADD', stream, 'NOMKSTREAM', '*', unpack(args, i, i + n - 1))
  if not id then return nil, redis.error_reply('NOSTREAM ' .. stream) end
  return id
end

-- KEYS lease prompts inflight run; ARGV token issued|'' then (traj_id, n, fields ...) ...
local function issue(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  local ids, i = {}, 3
  while i <= #args do
    local n = tonumber(args[i + 1])
    local id, err = xadd(keys[2], args, i + 2, n)
    if err then return err end
    redis.call('HSET', keys[3], args[i], id)
    ids[#ids + 1] = id
    i = i + 2 + n
  end
  if args[2] ~= '' then redis.call('HSET', keys[4], 'issued', args[2]) end
  return ids
end

-- KEYS lease prompts inflight run; ARGV token owner|'' then (traj_id, old entry id) ...
-- Adds an unfinished prompt again under its traj_id, marked `reissued`: one held by `owner`
-- (acknowledged for it), or with owner '' one acknowledged without a trajectory the learner
-- could use.
local function reissue(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  local out = {}
  for i = 3, #args - 1, 2 do
    local t, old = args[i], args[i + 1]
    if redis.call('HGET', keys[3], t) == old then
      local p = redis.call('XPENDING', keys[2], 'gen', old, old, 1)
      local by = p[1] and p[1][2] or ''
      local e = redis.call('XRANGE', keys[2], old, old)
      if by == args[2] and e[1] then
        local f = e[1][2]
        if f[#f - 1] ~= 'reissued' then f[#f + 1] = 'reissued'; f[#f + 1] = '1' end
        local id = redis.call('XADD', keys[2], 'NOMKSTREAM', '*', unpack(f))
        if by ~= '' then redis.call('XACK', keys[2], 'gen', old) end
        redis.call('HSET', keys[3], t, id)
        redis.call('HINCRBY', keys[4], 'reissued', 1)
        out[#out + 1] = t
      end
    end
  end
  return out
end

-- KEYS stream prompts; ARGV (prompt entry id|'', n, fields ...) ...  (a generator's call)
-- Each entry is added first and its prompt acknowledged only once the XADD succeeded.
local function publish(keys, args)
  local ids, i = {}, 1
  while i <= #args do
    local n = tonumber(args[i + 1])
    local id, err = xadd(keys[1], args, i + 2, n)
    if err then return err end
    if args[i] ~= '' then redis.call('XACK', keys[2], 'gen', args[i]) end
    ids[#ids + 1] = id
    i = i + 2 + n
  end
  return ids
end

local function id_below(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end

-- KEYS lease inflight run; ARGV token replaced nstreams (stream n id ...) ... finished ...
-- Acknowledge trajectory entries; only if one of them was still pending (a first call, not a
-- replay of one that ran), forget the finished traj_ids and count `replaced`.
local function settle(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  local acked, i = 0, 4
  for _ = 1, tonumber(args[3]) do
    local n = tonumber(args[i + 1])
    acked = acked + redis.call('XACK', args[i], 'learner', unpack(args, i + 2, i + 1 + n))
    i = i + 2 + n
  end
  if acked > 0 or args[3] == '0' then
    if i <= #args then redis.call('HDEL', keys[2], unpack(args, i, #args)) end
    if tonumber(args[2]) > 0 then redis.call('HINCRBY', keys[3], 'replaced', args[2]) end
  end
  return acked
end

local function fields(flat)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  return f
end

-- KEYS lease stream generators; ARGV token generator_id future_ms max_unacked keep_from keep_ms
-- One generator's stream checked against what only its writer can have done, then trimmed below
-- the learner group's oldest pending entry (or its last delivered one), `keep_from` and the
-- entries of the last keep_ms milliseconds.
local function check_stream(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  if redis.call('EXISTS', keys[2]) == 0 then return {'missing'} end
  local info = fields(redis.call('XINFO', 'STREAM', keys[2]))
  local counter = args[2] .. ':trimmed'
  local trimmed = tonumber(redis.call('HGET', keys[3], counter) or '0')
  local added, length = info['entries-added'], info['length']
  local last = info['last-generated-id']
  if added - trimmed ~= length then
    return {'trimmed', tostring(added - trimmed - length) .. ' entries deleted by another client'}
  end
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local ms = tonumber(string.match(last, '^(%d+)-'))
  if ms > now_ms + tonumber(args[3]) then
    return {'bricked', 'entry id ' .. last .. ' lies in the future'}
  end
  local group = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', keys[2])) do
    local gf = fields(g)
    if gf['name'] == 'learner' then group = gf end
  end
  if not group then return {'nogroup'} end
  local floor = group['last-delivered-id']
  local pending = redis.call('XPENDING', keys[2], 'learner')
  if pending[1] > 0 and id_below(pending[2], floor) then floor = pending[2] end
  if args[5] ~= '' and id_below(args[5], floor) then floor = args[5] end
  local recent = string.format('%d-0', now_ms - tonumber(args[6]))
  if id_below(recent, floor) then floor = recent end
  local n = redis.call('XTRIM', keys[2], 'MINID', floor)
  if n > 0 then redis.call('HINCRBY', keys[3], counter, n) end
  local read = tonumber(group['entries-read'])  -- unknown after deletions ahead of the group
  local unacked = read and (pending[1] + added - read) or 0
  if unacked > tonumber(args[4]) then
    return {'flooded', tostring(unacked) .. ' entries not yet acknowledged'}
  end
  return {'ok', tostring(length - n), tostring(added), last}
end

-- KEYS lease generators joined stream dlq heartbeat; ARGV token generator_id
local function admit(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  local status = redis.call('HGET', keys[2], args[2])
  if status then
    redis.call('SREM', keys[3], args[2])
    return status
  end
  if redis.call('EXISTS', keys[6]) == 0 then return false end
  if redis.call('EXISTS', keys[4]) == 0 then
    redis.call('XGROUP', 'CREATE', keys[4], 'learner', '0', 'MKSTREAM')
    redis.call('HSET', keys[2], args[2] .. ':trimmed', 0)
  end
  if redis.call('EXISTS', keys[5]) == 0 then
    redis.call('XGROUP', 'CREATE', keys[5], 'x', '$', 'MKSTREAM')
    redis.call('XGROUP', 'DESTROY', keys[5], 'x')
  end
  redis.call('HSET', keys[2], args[2], 'active')
  redis.call('SREM', keys[3], args[2])
  return 'active'
end

-- KEYS lease generators run; ARGV token generator_id reason
local function quarantine(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  if redis.call('HGET', keys[2], args[2]) ~= 'active' then return 0 end
  redis.call('HSET', keys[2], args[2], 'quarantined ' .. args[3])
  redis.call('HINCRBY', keys[3], 'quarantined', 1)
  return 1
end

-- KEYS lease generators stream dlq heartbeat; ARGV token generator_id
-- Forget a generator that stopped beating once nothing of its stream is left to read.
local function retire(keys, args)
  if not lease_ok(keys[1], args[1]) then return lost(keys[1]) end
  if redis.call('EXISTS', keys[5]) == 1 then return 0 end
  if redis.call('EXISTS', keys[4]) == 1 and redis.call('XLEN', keys[4]) > 0 then return 0 end
  if redis.call('EXISTS', keys[3]) == 1 then
    if redis.call('XPENDING', keys[3], 'learner')[1] > 0 then return 0 end
    local info = fields(redis.call('XINFO', 'STREAM', keys[3]))
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', keys[3])) do
      local gf = fields(g)
      if gf['name'] == 'learner' and gf['last-delivered-id'] ~= info['last-generated-id'] then
        return 0
      end
    end
  end
  redis.call('DEL', keys[3], keys[4])
  redis.call('HDEL', keys[2], args[2], args[2] .. ':trimmed')
  return 1
end

redis.register_function('rf_@_lease_take', lease_take)
redis.register_function{function_name='rf_@_lease_renew', callback=lease_renew,
  flags={'allow-oom'}}  -- PEXPIRE only: a full Redis must not expire the learner's lease
redis.register_function('rf_@_lease_release', lease_release)
redis.register_function('rf_@_lease_release_dead', lease_release_dead)
redis.register_function('rf_@_fenced', fenced)
redis.register_function('rf_@_issue', issue)
redis.register_function('rf_@_settle', settle)
redis.register_function('rf_@_reissue', reissue)
redis.register_function('rf_@_publish', publish)
redis.register_function('rf_@_check_stream', check_stream)
redis.register_function('rf_@_admit', admit)
redis.register_function('rf_@_quarantine', quarantine)
redis.register_function('rf_@_retire', retire)
"""

DIGEST = hashlib.sha256(_LUA.encode()).hexdigest()[:12]
LIBRARY = f"rollflash_{DIGEST}"
CODE = f"#!lua name={LIBRARY}\n" + _LUA.replace("rf_@_", f"rf_{DIGEST}_")


def name(function: str) -> str:
    """The library's name for `function` (e.g. `publish` -> `rf_<digest>_publish`)."""
    return f"rf_{DIGEST}_{function}"


def load(client: redis.Redis) -> None:
    """Load the library unless this version of it is there already (the learner, at start)."""
    try:
        client.function_load(CODE)
    except redis.ResponseError as e:
        if "already exists" not in str(e):
            raise


def missing(e: Exception) -> bool:
    """Redis does not know the function: it lost its data, or no learner loaded the library."""
    return isinstance(e, redis.ResponseError) and "Function not found" in str(e)


def fcall(client: Any, function: str, keys: list[str], args: list[Any]) -> Any:
    """FCALL one of the library's functions."""
    return client.fcall(name(function), len(keys), *keys, *args)
