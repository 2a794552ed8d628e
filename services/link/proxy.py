"""The link itself: an asyncio TCP proxy that holds every chunk for RTT/2 in each direction.

Each direction of a connection has a reader and a writer task joined by a
queue: the reader stamps each chunk with the time it may leave
(`chunk_due`) and reads on at once, so the delay is a latency, not a
throughput limit; the writer sends chunks in arrival order, each no earlier
than its stamp. Jitter adds a random 0..JITTER/2 per chunk and direction,
but a stamp is never earlier than the one before it: a TCP stream is never
reordered. When either side closes (or fails), what is already on its way
in that direction is delivered, late as it should be, and both sides are
closed. Opening a connection is not delayed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from services.link.spec import LinkSpec

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 256  # per direction: a reader this far ahead of its writer waits (at most 16 MiB held)


def chunk_due(now: float, previous_due: float, one_way_s: float, extra_s: float = 0.0) -> float:
    """When a chunk read at `now` may leave: one way later, plus its jitter, and never before the chunk read
    before it in the same direction (so a stream keeps its order)."""
    assert one_way_s >= 0 and extra_s >= 0
    return max(previous_due, now + one_way_s + extra_s)


@dataclass
class LinkCounters:
    connections: int = 0  # open now
    accepted: int = 0  # since start
    bytes_up: int = 0  # client -> upstream
    bytes_down: int = 0  # upstream -> client


@dataclass
class LinkProxy:
    """Listens on host:port and forwards to upstream_host:upstream_port through the link `spec` (which
    `apply` may change while it runs: chunks read from then on get the new delay)."""

    spec: LinkSpec
    upstream_host: str
    upstream_port: int
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound one after start()
    seed: int | None = None
    counters: LinkCounters = field(default_factory=LinkCounters)
    _server: asyncio.AbstractServer | None = field(default=None, init=False)
    _writers: set = field(default_factory=set, init=False)  # both sides of every open connection
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def apply(self, spec: LinkSpec) -> None:
        if spec != self.spec:
            logger.info("link: %s (was %s)", spec.describe(), self.spec.describe())
            self.spec = spec

    async def start(self) -> "LinkProxy":
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("link on %s:%d -> %s:%d, %s", self.host, self.port, self.upstream_host, self.upstream_port,
                    self.spec.describe())
        return self

    async def close(self) -> None:
        """Stop accepting and close every open connection (Python 3.12's wait_closed waits for them)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except asyncio.TimeoutError:
                logger.warning("link: connections still open at close")

    def _delay_s(self) -> float:
        spec = self.spec
        return spec.one_way_s + (self._rng.uniform(0.0, spec.one_way_jitter_s) if spec.jitter_ms else 0.0)

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError as exc:  # upstream away (Redis restarting): the client sees a closed connection
            logger.warning("link: cannot reach %s:%d (%s); closing the client's connection", self.upstream_host,
                           self.upstream_port, exc)
            client_writer.close()
            return
        self.counters.connections += 1
        self.counters.accepted += 1
        self._writers.update((client_writer, upstream_writer))
        directions = [asyncio.create_task(self._carry(client_reader, upstream_writer, "bytes_up")),
                      asyncio.create_task(self._carry(upstream_reader, client_writer, "bytes_down"))]
        try:
            await asyncio.wait(directions, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in directions:
                task.cancel()
            await asyncio.gather(*directions, return_exceptions=True)
            for writer in (client_writer, upstream_writer):
                writer.close()
                self._writers.discard(writer)
            self.counters.connections -= 1

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """One direction until its end (EOF or an error), delivered with the link's delay; b"" marks the end."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        async def read() -> None:
            due = 0.0
            try:
                while data := await reader.read(CHUNK_BYTES):
                    due = chunk_due(loop.time(), due, self._delay_s())
                    await queue.put((due, data))
            except (ConnectionError, OSError) as exc:
                logger.debug("link: read ended: %s", exc)
            await queue.put((chunk_due(loop.time(), due, self._delay_s()), b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                due, data = await queue.get()
                wait_s = due - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                if not data:
                    return
                writer.write(data)
                await writer.drain()
                setattr(self.counters, counter, getattr(self.counters, counter) + len(data))
        except (ConnectionError, OSError) as exc:
            logger.debug("link: write ended: %s", exc)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
