"""A link's setting (`RTT_MS[:JITTER_MS]`), parsed and checked, and Redis URLs routed through a link."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from services.redis_url import redacted

logger = logging.getLogger(__name__)

LINK_HELP = "RTT_MS[:JITTER_MS], e.g. 20 or 20:5 (milliseconds, >= 0)"


@dataclass(frozen=True)
class LinkSpec:
    """What a link adds to a round trip: rtt_ms always, plus up to jitter_ms (random, per chunk)."""

    rtt_ms: float
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("rtt_ms", self.rtt_ms), ("jitter_ms", self.jitter_ms)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value!r}")

    @property
    def one_way_s(self) -> float:
        """Each direction holds a chunk for half the round trip."""
        return self.rtt_ms / 2000.0

    @property
    def one_way_jitter_s(self) -> float:
        return self.jitter_ms / 2000.0

    def label(self) -> str:
        """As written on the command line: 20, 20:5 (also a folder name)."""
        return _ms(self.rtt_ms) + (f":{_ms(self.jitter_ms)}" if self.jitter_ms else "")

    def describe(self) -> str:
        return f"RTT {_ms(self.rtt_ms)} ms" + (f" + jitter up to {_ms(self.jitter_ms)} ms" if self.jitter_ms else "")


def _ms(value: float) -> str:
    return f"{value:g}"


def parse_link(text: str) -> LinkSpec:
    """`RTT_MS` or `RTT_MS:JITTER_MS`; a ValueError naming the bad value otherwise."""
    parts = text.strip().split(":")
    if len(parts) > 2 or not all(part.strip() for part in parts):
        raise ValueError(f"{text!r} is not {LINK_HELP}")
    values = []
    for part, name in zip(parts, ("RTT", "jitter")):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{text!r}: {name} {part.strip()!r} is not a number of milliseconds "
                             f"(use {LINK_HELP})") from None
        if not math.isfinite(value):
            raise ValueError(f"{text!r}: {name} {part.strip()!r} is not a finite number of milliseconds")
        if value < 0:
            raise ValueError(f"{text!r}: {name} {part.strip()} ms is negative (a link cannot take time back)")
        values.append(value)
    return LinkSpec(*values)


def parse_link_levels(text: str) -> list[LinkSpec]:
    """A comma list of links (`0,20,50`, `0,20:5`), in the order given, each once."""
    levels = [parse_link(part) for part in text.split(",") if part.strip()]
    if not levels:
        raise ValueError(f"{text!r}: give one or more links, comma separated, each {LINK_HELP}")
    return list(dict.fromkeys(levels))


def redis_address(url: str) -> tuple[str, int]:
    """Host and port of a redis:// URL (what a link forwards to)."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"a link forwards TCP to one redis:// server, not {redacted(url)!r} (a Sentinel set: "
                         "run the link in front of the primary with `mirror-sd link --to redis://...`)")
    return parts.hostname or "127.0.0.1", parts.port or 6379


def behind_link(url: str, host: str, port: int) -> str:
    """The same Redis URL (password, database, options) reached through a link listening on host:port."""
    parts = urlsplit(url)
    redis_address(url)  # refuses what a link cannot carry
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
