"""Where Redis is: one URL for every process, a single server or a Sentinel set.

Single server: `redis://`, `rediss://` (TLS) or `unix://`, as redis-py reads them.

Sentinel: `redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB]`
- the hosts are the sentinels (port 26379 when left out); IPv6 hosts in brackets;
- the user and password are the primary's and replicas' (`requirepass`/ACL);
- `?sentinel_password=...` when the sentinels themselves ask for one.

Pure parsing: the clients built from it are in services/redis_client.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

PLAIN_SCHEMES = ("redis://", "rediss://", "unix://")
SENTINEL_SCHEME = "redis+sentinel://"
SCHEMES = PLAIN_SCHEMES + (SENTINEL_SCHEME,)
SENTINEL_PORT = 26379
_QUERY = ("sentinel_password",)


@dataclass(frozen=True)
class SentinelTarget:
    """A Redis primary found through its sentinels."""
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    def describe(self) -> str:
        """For logs and `mirror-sd status`: never the password."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"sentinel master {self.master!r} db {self.db} via {hosts}"


def redacted(url: str) -> str:
    """The URL with its password (if any) replaced by ***, for messages and logs."""
    url = re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    auth, at, hosts = rest.partition("@")
    if not at or ":" not in auth:
        return url
    return f"{scheme}{sep}{auth.partition(':')[0]}:***@{hosts}"


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def check_redis_url(url: str) -> str:
    """The URL when it is one we can use, else ValueError saying what is wrong with it."""
    if is_sentinel(url):
        parse_sentinel_url(url)
    elif not url.startswith(PLAIN_SCHEMES):
        raise ValueError(f"must be a {', '.join(SCHEMES)} URL, got {redacted(url)!r}")
    return url


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [::1]:26379
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"sentinel host missing in {item!r} of {redacted(url)!r}")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad sentinel port {port_text!r} in {redacted(url)!r}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`redis+sentinel://...` as a SentinelTarget; ValueError naming the bad part."""
    if not is_sentinel(url):
        raise ValueError(f"not a {SENTINEL_SCHEME} URL: {redacted(url)!r}")
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"no sentinel host in {redacted(url)!r}: "
                         f"{SENTINEL_SCHEME}HOST:PORT[,HOST:PORT...]/MASTER_NAME/DB")
    sentinels = tuple(_host_port(item.strip(), url) for item in hosts.split(",") if item.strip())
    path = [piece for piece in parts.path.split("/") if piece]
    if not path:
        raise ValueError(f"no master name in {redacted(url)!r}: {SENTINEL_SCHEME}HOST:PORT/MASTER_NAME/DB")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"bad path {parts.path!r} in {redacted(url)!r}: expected /MASTER_NAME or /MASTER_NAME/DB")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - set(_QUERY))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in {redacted(url)!r}; "
                         f"known: {', '.join(_QUERY)}")
    username, _, password = auth.partition(":") if auth else ("", "", "")
    return SentinelTarget(
        sentinels=sentinels, master=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None, password=unquote(password) or None,
        sentinel_password=query.get("sentinel_password", [None])[0])


def celery_broker(url: str) -> tuple[str, str, dict]:
    """kombu's and Celery's forms of a URL: (broker URL, result backend URL, transport options). A plain
    URL passes unchanged. For Sentinel the broker URL names one sentinel and the transport options all of
    them (services/celery_transport.py says why); the result backend takes them as ';' alternates."""
    if not is_sentinel(url):
        return url, url, {}
    target = parse_sentinel_url(url)
    auth = ""
    if target.password or target.username:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    hosts = [f"[{host}]" if ":" in host else host for host, _ in target.sentinels]
    urls = [f"sentinel://{auth}{host}:{port}/{target.db}" for host, (_, port) in zip(hosts, target.sentinels)]
    options: dict = {"master_name": target.master, "sentinels": [list(address) for address in target.sentinels]}
    if target.sentinel_password:
        options["sentinel_kwargs"] = {"password": target.sentinel_password}
    return urls[0], ";".join(urls), options
