"""The link's proxy on loopback sockets: it delays by at least its setting, never reorders, carries large
payloads intact and closes both sides when one closes. Timing is asserted as a lower bound only."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services.link.proxy import LinkProxy, chunk_due
from services.link.spec import LinkSpec


def test_a_chunk_leaves_one_way_later_plus_its_jitter_and_never_before_the_one_before_it():
    assert chunk_due(10.0, 0.0, 0.020) == pytest.approx(10.020)
    assert chunk_due(10.0, 0.0, 0.020, 0.004) == pytest.approx(10.024)
    assert chunk_due(10.001, 10.030, 0.020) == 10.030  # a shorter jitter than the last chunk's waits for it
    assert chunk_due(10.0, 0.0, 0.0) == 10.0


async def _echo_server() -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """Echoes what it gets; records b"EOF" when a client closes on it."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        seen.append(b"EOF")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def _linked(spec: LinkSpec, upstream_port: int, seed: int = 0) -> LinkProxy:
    return await LinkProxy(spec, "127.0.0.1", upstream_port, seed=seed).start()


async def _read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(size), 30)


def test_a_round_trip_takes_at_least_the_links_rtt():
    async def scenario() -> list[float]:
        server, port, _ = await _echo_server()
        proxy = await _linked(LinkSpec(40), port)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        trips = []
        for _ in range(3):
            started = time.perf_counter()
            writer.write(b"PING\r\n")
            await _read_exactly(reader, 6)
            trips.append(time.perf_counter() - started)
        proxy.apply(LinkSpec(80))  # changed while it runs: the next chunks take the new delay
        started = time.perf_counter()
        writer.write(b"PING\r\n")
        await _read_exactly(reader, 6)
        trips.append(time.perf_counter() - started)
        writer.close()
        await proxy.close()
        server.close()
        return trips

    trips = asyncio.run(scenario())
    assert min(trips[:3]) >= 0.035, trips
    assert trips[3] >= 0.075, trips


def test_jitter_never_reorders_a_stream():
    async def scenario() -> tuple[bytes, bytes]:
        server, port, _ = await _echo_server()
        proxy = await _linked(LinkSpec(4, 30), port, seed=1)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        sent = b"".join(f"{index:05d};".encode() for index in range(400))
        for start in range(0, len(sent), 6):  # one write per number, a few at a time: many separate chunks
            writer.write(sent[start:start + 6])
            await writer.drain()
            if start % 60 == 0:
                await asyncio.sleep(0.001)
        received = await _read_exactly(reader, len(sent))
        writer.close()
        await proxy.close()
        server.close()
        return sent, received

    sent, received = asyncio.run(scenario())
    assert received == sent


def test_a_large_payload_arrives_intact_both_ways():
    payload = os.urandom(8 * 1024 * 1024 + 13)

    async def scenario() -> tuple[bytes, LinkProxy]:
        server, port, _ = await _echo_server()
        proxy = await _linked(LinkSpec(10, 4), port, seed=2)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)

        async def send() -> None:
            writer.write(payload)
            await writer.drain()

        sending = asyncio.create_task(send())
        received = await _read_exactly(reader, len(payload))
        await sending
        writer.close()
        await proxy.close()
        server.close()
        return received, proxy

    received, proxy = asyncio.run(scenario())
    assert received == payload
    assert proxy.counters.bytes_up == proxy.counters.bytes_down == len(payload)


def test_a_client_closing_closes_the_upstream_side():
    async def scenario() -> tuple[list[bytes], LinkProxy]:
        server, port, seen = await _echo_server()
        proxy = await _linked(LinkSpec(20), port)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"hello")
        assert await _read_exactly(reader, 5) == b"hello"
        assert proxy.counters.connections == 1
        writer.close()
        for _ in range(200):  # the close travels the link too
            if seen:
                break
            await asyncio.sleep(0.01)
        for _ in range(100):
            if proxy.counters.connections == 0:
                break
            await asyncio.sleep(0.01)
        await proxy.close()
        server.close()
        return seen, proxy

    seen, proxy = asyncio.run(scenario())
    assert seen == [b"EOF"]
    assert proxy.counters.connections == 0 and proxy.counters.accepted == 1


def test_the_upstream_closing_closes_the_client_side_after_what_it_sent():
    async def scenario() -> tuple[bytes, float]:
        async def say_bye(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"bye")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(say_bye, "127.0.0.1", 0)
        proxy = await _linked(LinkSpec(30), server.sockets[0].getsockname()[1])
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        received = await asyncio.wait_for(reader.read(), 10)  # to EOF
        elapsed = time.perf_counter() - started
        writer.close()
        await proxy.close()
        server.close()
        return received, elapsed

    received, elapsed = asyncio.run(scenario())
    assert received == b"bye"
    assert elapsed >= 0.014  # one way: the bytes and the close come the link's way


def test_an_unreachable_upstream_closes_the_client():
    async def scenario() -> bytes:
        with __import__("socket").socket() as probe:  # a port nobody listens on
            probe.bind(("127.0.0.1", 0))
            dead_port = probe.getsockname()[1]
        proxy = await _linked(LinkSpec(0), dead_port)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        received = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await proxy.close()
        return received

    assert asyncio.run(scenario()) == b""


def test_closing_the_link_closes_its_open_connections():
    async def scenario() -> bytes:
        server, port, _ = await _echo_server()
        proxy = await _linked(LinkSpec(10), port)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"hi")
        assert await _read_exactly(reader, 2) == b"hi"
        await asyncio.wait_for(proxy.close(), 10)
        received = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        server.close()
        return received

    assert asyncio.run(scenario()) == b""
