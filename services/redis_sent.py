"""Commands written to Redis now, their replies read later: a round trip that overlaps other work.

A pipeline's execute() writes its commands and then waits for every reply. A verify worker's commits need not be
waited for before its next forward: Redis applies them as soon as it reads them (the gateway sees the tokens then),
and only the worker's bookkeeping of the replies (a lost commit, a finished request) waits for them. `SentCommands`
holds one connection from the client's pool between the write and the read; Redis answers a connection's commands in
the order it sent them, so a later batch on another connection never overtakes what this one said about a stream
only when the caller reads one batch's replies before it writes anything that depends on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.exceptions import ResponseError


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
