"""A session the gateway opened (SessionSpec.opened): the answer to its round 0 on the way to the driver.

The gateway sends round 0 to the verify pool itself, while the session's
task travels to a draft worker, so the first token waits for the target's
prefill alone, not for a draft worker's start over its link. The gateway
knows no draft worker's inbox, so that round's BlockTaken note and verdict
go to the request's own verdict list. While the session waits for them, a
relay thread keeps a blocking move (BLMOVE) from that list into this
process's inbox: the inbox listener then finds them like any other, half a
link trip after the verify worker pushed them. The relay ends with the first
verdict it moves, or with the session.

A verdict already there when the session started (round 0 committed first)
is not relayed: the session resumes from the committed output, and takes
from that verdict, read when it opened (services/redis_client.py,
open_session), only the load its verify worker told. That is the load a
burst's first request meets: its opening ran alone while the rest came in
(verify_worker/told_load.py), and the load the draft worker's other sessions
heard last may be from before the burst. The list expires with the request.
"""

from __future__ import annotations

import logging
import threading

import redis

from services import protocol
from services.protocol import BlockTaken, ProtocolError, Verdict, decode_one_of

logger = logging.getLogger(__name__)

MOVE_WAIT_S = 1.0  # one blocking move's server-side wait; the session's end is noticed within it


def relay_opening(client: redis.Redis, request_id: str, inbox: str, ended: threading.Event) -> threading.Thread:
    """Start moving the request's round-0 answers into `inbox` until a verdict has gone or `ended` is set."""
    thread = threading.Thread(target=_relay, args=(client, request_id, inbox, ended), daemon=True,
                              name=f"opening-{request_id[-8:]}")
    thread.start()
    return thread


def _relay(client: redis.Redis, request_id: str, inbox: str, ended: threading.Event) -> None:
    source = protocol.verdict_queue(request_id)
    while not ended.is_set():
        try:
            raw = client.blmove(source, inbox, MOVE_WAIT_S, "LEFT", "RIGHT")
        except redis.RedisError as exc:  # Redis away: the driver's deadlines resend round 0 if it was lost
            logger.warning("request %s: opening relay: %s", request_id, exc)
            ended.wait(0.5)
            continue
        if raw is None:
            continue
        try:
            message = decode_one_of(raw, (Verdict, BlockTaken))
        except ProtocolError:
            continue  # the driver drops it too
        if isinstance(message, Verdict):
            return
