"""Redis connections, the atomic 'commit a round' script shared by the workers, and commands whose replies are
read later (SentCommands)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.exceptions import ResponseError

from services import protocol
from services.protocol import (
    CHILDREN_KEY,
    HEARTBEAT_PATTERN,
    ROUTING_TABLE_KEY,
    BlockTaken,
    ChildStatus,
    Heartbeat,
    OutputEvent,
    ProtocolError,
    RoutingTable,
    Verdict,
    decode_one_of,
)

logger = logging.getLogger(__name__)

# Retention of per-request keys (spec, output stream, verdicts) after the last write.
REQUEST_TTL_S = 3600

# Compare-and-delete: drop a session's lease only while `instance` holds it (a driver that lost it to another, or
# a gateway reviving a dead owner's session, never drops a live owner's).
RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def release_lease(client, request_id: str, instance: str):
    """Drop the session's lease if `instance` holds it: 1 dropped, 0 not (awaitable on an asyncio client)."""
    return client.eval(RELEASE_LEASE_LUA, 1, protocol.lease_key(request_id), instance)


# A draft task's start in one round trip: the request's spec; its lease, taken only if free (and then the owner key
# names the taker); the output events so far. A task's first moves used to be four round trips one after another
# (spec, lease, owner, events): over a 50 ms link, 200 ms before its draft began to prefill.
OPEN_SESSION_LUA = """
local spec = redis.call('GET', KEYS[1])
if not spec then
  return {false, 0, {}, {}}
end
local leased = 0
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', ARGV[2]) then
  leased = 1
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[3])
end
return {spec, leased, redis.call('XRANGE', KEYS[4], '-', '+'), redis.call('LRANGE', KEYS[5], 0, -1)}
"""


@dataclass(frozen=True)
class OpenedSession:
    spec: bytes | None  # None: no such request (expired or never created)
    leased: bool  # the lease is the caller's now
    events: list[OutputEvent]
    # the verdict of round 0 already on the request's own list (SessionSpec.opened: the gateway sent round 0),
    # when it came before the session started: the load its verify worker told (draft_worker/opening.py)
    opening: Verdict | None = None


def open_session(client: redis.Redis, request_id: str, instance: str, lease_ttl_s: int) -> OpenedSession:
    """One round trip: the request's spec, its lease for `instance` if nobody holds it, its output events, and
    its opening's verdict when that is on the request's own list."""
    keys = [protocol.request_key(request_id), protocol.lease_key(request_id), protocol.owner_key(request_id),
            protocol.output_stream(request_id), protocol.verdict_queue(request_id)]
    spec, leased, entries, answers = client.eval(OPEN_SESSION_LUA, len(keys), *keys, instance, lease_ttl_s,
                                                 REQUEST_TTL_S)
    # XRANGE inside a script comes back raw: [id, [field, value, ...]] per entry
    events = [OutputEvent.decode(dict(zip(fields[::2], fields[1::2]))[b"m"]) for _, fields in entries]
    return OpenedSession(spec, bool(leased), events, _last_verdict(answers))


def _last_verdict(answers: list[bytes]) -> Verdict | None:
    """The last verdict a verify worker made among a request's own list (its BlockTaken notes and verdicts): not a
    resync (answered from the stream, worker_id "", telling no load), nor a bad message."""
    for raw in reversed(answers):
        try:
            message = decode_one_of(raw, (Verdict, BlockTaken))
        except ProtocolError:
            continue
        if isinstance(message, Verdict) and message.worker_id:
            return message
    return None


# Append one output event and push its verdict, only if the stream holds exactly
# `expected_seq` events: a second verifier of the same round (a worker thought
# dead that was only slow) then cannot commit twice. One round trip. Without an
# event (a resync) the verdict is pushed alone.
COMMIT_ROUND_LUA = """
if ARGV[2] ~= '' then
  local have = redis.call('XLEN', KEYS[1])
  if have ~= tonumber(ARGV[1]) then
    return have
  end
  redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
if ARGV[3] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return -1
"""


class RoundCommitter:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._script = client.register_script(COMMIT_ROUND_LUA)

    def command(self, *, stream_key: str, verdict_key: str, expected_seq: int, event: bytes,
                verdict: bytes) -> tuple:
        """The commit as one EVALSHA command (SentCommands writes a batch of them); its reply is
        commit()'s, or a NoScriptError after Redis lost its scripts (a restart): load() it, then commit again."""
        return ("EVALSHA", self._script.sha, 2, stream_key, verdict_key, expected_seq, event, verdict, REQUEST_TTL_S)

    def load(self) -> None:
        self._client.script_load(COMMIT_ROUND_LUA)

    def commit(self, *, stream_key: str, verdict_key: str, expected_seq: int, event: bytes, verdict: bytes,
               client: redis.Redis | None = None) -> int | None:
        """-1 when committed; otherwise the stream's real length (someone else got there first). With a
        pipeline as `client` the call is queued and its reply comes from the pipeline's execute()."""
        reply = self._script(keys=[stream_key, verdict_key], args=[expected_seq, event, verdict, REQUEST_TTL_S],
                             client=client)
        return None if client is not None else int(reply)


def read_events(client: redis.Redis, request_id: str) -> list[OutputEvent]:
    """Every output event of a request so far, in order."""
    return [OutputEvent.decode(fields[b"m"]) for _, fields in client.xrange(protocol.output_stream(request_id))]


def decode_all(kind: type, raws, what: str) -> list:
    """The messages of type `kind` among raw values: missing ones (expired keys) and bad ones skipped."""
    decoded = []
    for raw in raws:
        if raw is None:
            continue
        try:
            decoded.append(kind.decode(raw))
        except ProtocolError as exc:
            logger.warning("ignoring a bad %s: %s", what, exc)
    return decoded


def decode_children(raw: dict) -> list[ChildStatus]:
    """The supervisor's hash (CHILDREN_KEY) as ChildStatus messages, by name; bad entries are skipped."""
    return decode_all(ChildStatus, (value for _, value in sorted(raw.items())), "child status")


def read_children(client: redis.Redis) -> list[ChildStatus]:
    """What `mirror-sd up`'s supervisor last published of its children (empty: no supervisor, e.g. compose)."""
    return decode_children(client.hgetall(CHILDREN_KEY))


def read_routing_table(client: redis.Redis) -> RoutingTable | None:
    """The telemetry service's latest routing table (None before its first)."""
    raw = client.get(ROUTING_TABLE_KEY)
    return RoutingTable.decode(raw) if raw is not None else None


def write_heartbeat(client: redis.Redis, beat: Heartbeat, ttl_s: float) -> None:
    """A worker's heartbeat, gone unless written again within ttl_s (its absence says the worker is)."""
    client.set(protocol.heartbeat_key(beat.worker_id), beat.encode(), px=int(ttl_s * 1000))


def decode_heartbeats(raws: list[bytes | None]) -> list[Heartbeat]:
    """The heartbeats among raw values (expired keys and bad entries skipped)."""
    return decode_all(Heartbeat, raws, "heartbeat")


def read_heartbeats(client: redis.Redis) -> list[Heartbeat]:
    """Every live worker's heartbeat."""
    keys = list(client.scan_iter(match=HEARTBEAT_PATTERN, count=200))
    return decode_heartbeats(client.mget(keys) if keys else [])


async def read_heartbeats_async(client) -> list[Heartbeat]:
    """read_heartbeats for an asyncio client (the gateway's)."""
    keys = [key async for key in client.scan_iter(match=HEARTBEAT_PATTERN, count=200)]
    return decode_heartbeats(await client.mget(keys) if keys else [])


# Commands written to Redis now, their replies read later: a round trip that overlaps other work.
#
# A pipeline's execute() writes its commands and then waits for every reply. A verify worker's commits need not be
# waited for before its next forward: Redis applies them as soon as it reads them (the gateway sees the tokens then),
# and only the worker's bookkeeping of the replies (a lost commit, a finished request) waits for them. `SentCommands`
# holds one connection from the client's pool between the write and the read. Redis runs one connection's commands in
# the order they came, but nothing orders two connections: a caller reads a batch's replies before it sends, on
# another connection, anything that depends on the batch's effects (verify_worker/commits.py settles first).


class SentCommands:
    """One batch of commands written on a connection of `client`'s pool; `replies()` reads their replies (an
    error reply comes back as its exception, in its place) and gives the connection back. A connection error while
    writing or reading drops the connection and is raised."""

    def __init__(self, client: redis.Redis, commands: Sequence[Sequence[object]]) -> None:
        self._pool = client.connection_pool
        self._count = len(commands)
        self._connection = self._pool.get_connection()
        try:
            self._connection.send_packed_command(self._connection.pack_commands(commands))
        except BaseException:
            self._drop()
            raise

    def replies(self) -> list[object]:
        if self._connection is None:
            raise RuntimeError("the replies of these commands were read already")
        replies: list[object] = []
        try:
            for _ in range(self._count):
                try:
                    replies.append(self._connection.read_response())
                except ResponseError as exc:  # this command's error; the ones after it still answer
                    replies.append(exc)
        except BaseException:
            self._drop()
            raise
        self._pool.release(self._connection)
        self._connection = None
        return replies

    def abandon(self) -> None:
        """Forget the replies (the connection is closed: its unread replies must not reach another caller)."""
        if self._connection is not None:
            self._drop()

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        try:
            connection.disconnect()
        finally:
            self._pool.release(connection)
