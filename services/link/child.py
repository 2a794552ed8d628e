"""The draft link as a child process of `mirror-sd up` (services/stack.py): its command, its start."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from services.link.spec import LinkSpec, behind_link
from services.protocol import DRAFT_LINK
from services.supervisor import Child

logger = logging.getLogger(__name__)


def link_command(spec: LinkSpec, redis_url: str, port: int, name: str = DRAFT_LINK) -> list[str]:
    """`mirror-sd link` in front of redis_url on a given port, under the name the bench looks for."""
    return [sys.executable, "-m", "services.cli", "link", spec.label(), "--to", redis_url, "--port", str(port),
            "--name", name]


def link_child(spec: LinkSpec, redis_url: str, env: dict[str, str], log_dir: Path | None) -> tuple[Child, str]:
    """The link's child (supervised like the others, essential: drafts behind a dead link cannot work) and the
    URL that reaches redis_url through it. The port is chosen now, so a restarted link listens where the
    draft worker already connects."""
    from services.stack import free_port  # services/stack.py starts links: imported here, not at the top

    port = free_port()
    child = Child("link", link_command(spec, redis_url, port), dict(env),
                  log_path=log_dir / "link.log" if log_dir else None, grace_s=5.0, essential=True)
    return child, behind_link(redis_url, "127.0.0.1", port)


def wait_listening(url: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the link at `url` accepts connections (not a PING: through the link that takes its RTT)."""
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the draft link did not start listening at {parts.hostname}:{parts.port}")
