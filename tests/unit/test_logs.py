"""JSON log lines: the fields a log pipeline indexes, and the request id wherever the code runs for one request."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import warnings
from datetime import datetime

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from services.config import Settings
from services.logs import bind_request, configure_logging, make_handler, request_context


@pytest.fixture
def captured():
    """A logger whose lines land in a buffer, through the handler every service uses."""
    stream = io.StringIO()
    handler = make_handler(service="verify-worker", worker_id="verify-cpu-0", log_format="json")
    handler.setStream(stream)
    log = logging.getLogger("mirror-sd-test.logs")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False

    def lines() -> list[dict]:
        text = stream.getvalue()
        assert text.endswith("\n")
        return [json.loads(line) for line in text.splitlines()]

    yield log, lines
    log.removeHandler(handler)


def test_a_line_is_one_json_object_with_the_indexed_fields(captured):
    log, lines = captured
    log.warning("step over %d rows", 3)
    (line,) = lines()
    assert line["message"] == "step over 3 rows"  # formatted, not the template
    assert line["level"] == "WARNING" and line["logger"] == "mirror-sd-test.logs"
    assert line["service"] == "verify-worker" and line["worker_id"] == "verify-cpu-0"
    assert line["request_id"] is None
    assert datetime.fromisoformat(line["ts"]).utcoffset().total_seconds() == 0


def test_request_id_from_extra_context_and_celery_task_lines(captured):
    log, lines = captured
    with request_context("cmpl-a"):
        log.info("in the task")
        log.info("about another", extra={"request_id": "cmpl-b"})  # the record's own id wins
    log.info("after")
    # what celery.app.trace logs when a task ends: a dict of arguments with the task id (= the request id)
    record = logging.LogRecord("celery.app.trace", logging.INFO, __file__, 1, "Task %(name)s[%(id)s] succeeded",
                               None, None)
    record.args = {"name": "run_session", "id": "chatcmpl-c"}
    log.handle(record)
    assert [line["request_id"] for line in lines()] == ["cmpl-a", "cmpl-b", None, "chatcmpl-c"]
    assert lines()[-1]["message"] == "Task run_session[chatcmpl-c] succeeded"


def test_a_traceback_stays_on_its_line(captured):
    log, lines = captured
    try:
        raise ValueError("bad block")
    except ValueError:
        log.exception("request %s: could not rebuild", "cmpl-x", extra={"request_id": "cmpl-x"})
    (line,) = lines()
    assert "ValueError: bad block" in line["exc_info"] and line["request_id"] == "cmpl-x"


def test_uvicorn_color_copy_is_dropped(captured):
    log, lines = captured
    log.info("Started server", extra={"color_message": "\x1b[1mStarted\x1b[0m server"})
    assert "color_message" not in lines()[0]


def test_gateway_bindings_stay_in_their_own_request_task(captured):
    """Each HTTP request runs in an asyncio task of its own: binding one request never shows in another."""
    log, lines = captured

    async def handle(request_id: str, other_started: asyncio.Event, mine_started: asyncio.Event) -> None:
        bind_request(request_id)
        mine_started.set()
        await other_started.wait()  # both are bound before either logs
        log.info("request %s done", request_id)

    async def main() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        await asyncio.gather(handle("cmpl-1", second, first), handle("cmpl-2", first, second))
        log.info("outside")

    asyncio.run(main())
    by_message = {line["message"]: line["request_id"] for line in lines()}
    assert by_message == {"request cmpl-1 done": "cmpl-1", "request cmpl-2 done": "cmpl-2", "outside": None}


def test_configure_logging_gives_the_root_one_handler_and_warnings_become_lines(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(service="telemetry", worker_id="telemetry-h", log_format="json")
        configure_logging(service="telemetry", worker_id="telemetry-h", log_format="json")  # idempotent
        assert len(root.handlers) == 1
        logging.getLogger("telemetry.service").info("routing v%d", 7)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("deprecated thing", UserWarning, stacklevel=1)
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [line["message"] for line in lines][0] == "routing v7"
        assert lines[1]["logger"] == "py.warnings" and "deprecated thing" in lines[1]["message"]
        assert {line["service"] for line in lines} == {"telemetry"}
    finally:
        logging.captureWarnings(False)
        root.handlers[:], root.level = saved


def test_log_format_setting_and_global_option(monkeypatch):
    assert Settings().log_format == "text"
    monkeypatch.setenv("MIRROR_SD_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    with pytest.raises(ValidationError, match="log_format"):
        Settings(log_format="xml")

    from services.cli import app

    monkeypatch.setenv("MIRROR_SD_LOG_FORMAT", "text")  # monkeypatch unsets it again after the test
    result = CliRunner().invoke(app, ["--log-format", "json", "status", "--help"])
    assert result.exit_code == 0, result.output
    assert os.environ["MIRROR_SD_LOG_FORMAT"] == "json"  # child processes inherit it
    assert CliRunner().invoke(app, ["--log-format", "xml", "status", "--help"]).exit_code == 2
