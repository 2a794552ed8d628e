"""The draft link's setting, the figures a draft worker measures of its link, and how they travel."""

from __future__ import annotations

import msgpack
import pytest
from typer.testing import CliRunner

from services.cli import app
from services.engine.draft_session import InFlight
from services.link.meter import TRIP_BLOCKS, TRIP_LIVENESS, LinkMeter, RoundTrip, smoothed, transport_ms
from services.link.spec import LinkSpec, behind_link, parse_link, parse_link_levels, redis_address
from services.protocol import PROTOCOL_VERSION, DraftBlock, Heartbeat, LinkFigures, LinkSetting, LinkStatus


@pytest.mark.parametrize("text, spec", [
    ("20", LinkSpec(20.0)), ("0", LinkSpec(0.0)), ("20:5", LinkSpec(20.0, 5.0)), (" 2.5 : 0.5 ", LinkSpec(2.5, 0.5)),
])
def test_parses_a_link(text, spec):
    assert parse_link(text) == spec


@pytest.mark.parametrize("text, named", [
    ("-5", "RTT -5 ms is negative"), ("20:-1", "jitter -1 ms is negative"), ("abc", "RTT 'abc' is not a number"),
    ("20:x", "jitter 'x' is not a number"), ("nan", "RTT 'nan' is not a finite number"), ("inf:1", "RTT 'inf'"),
    ("20:5:1", "'20:5:1' is not RTT_MS[:JITTER_MS]"), ("", "'' is not RTT_MS"), ("20:", "'20:' is not RTT_MS"),
])
def test_a_bad_link_is_refused_naming_the_value(text, named):
    with pytest.raises(ValueError, match=None) as refused:
        parse_link(text)
    assert named in str(refused.value)


def test_link_levels_keep_their_order_once_each():
    assert parse_link_levels("0,20,50,20") == [LinkSpec(0), LinkSpec(20), LinkSpec(50)]
    assert parse_link_levels("0, 20:5") == [LinkSpec(0), LinkSpec(20, 5)]
    with pytest.raises(ValueError, match="'0,x' .*|'x'"):
        parse_link_levels("0,x")
    with pytest.raises(ValueError, match="give one or more links"):
        parse_link_levels(" , ")


def test_a_spec_splits_its_round_trip_and_labels_itself():
    spec = LinkSpec(40, 10)
    assert spec.one_way_s == 0.02 and spec.one_way_jitter_s == 0.005
    assert spec.label() == "40:10" and LinkSpec(0.5).label() == "0.5"
    assert parse_link(spec.label()) == spec
    with pytest.raises(ValueError, match="rtt_ms"):
        LinkSpec(-1)


def test_a_url_behind_a_link_keeps_password_database_and_options():
    assert behind_link("redis://:secret@10.0.0.5:6380/3?socket_timeout=5", "127.0.0.1", 7001) == \
        "redis://:secret@127.0.0.1:7001/3?socket_timeout=5"
    assert behind_link("redis://127.0.0.1/0", "127.0.0.1", 7001) == "redis://127.0.0.1:7001/0"
    assert redis_address("redis://h:6390/1") == ("h", 6390) and redis_address("redis://h") == ("h", 6379)
    with pytest.raises(ValueError, match="one redis:// server"):
        redis_address("unix:///tmp/redis.sock")


def test_transport_is_the_round_trip_less_the_verify_time_and_the_drivers_other_work():
    assert transport_ms(0.100, 0.060, 0.010) == pytest.approx(30.0)
    assert transport_ms(0.100, 0.060, 0.0) == pytest.approx(40.0)
    assert transport_ms(0.050, 0.060, 0.0) == 0.0  # never negative
    assert transport_ms(0.050, -1.0, -1.0) == pytest.approx(50.0)  # a bad report subtracts nothing


def test_rtt_is_smoothed_and_the_meter_reports_its_window():
    assert smoothed(None, 10.0) == 10.0
    assert smoothed(10.0, 20.0) == pytest.approx(13.0)
    meter = LinkMeter(window=4)
    assert meter.figures() == LinkFigures()
    meter.observe_ping(20.0)
    meter.observe_ping(30.0)
    for index in range(6):
        meter.observe_round(RoundTrip(round_trip_ms=100.0 + index, transport_ms=40.0 + index, verify_ms=60.0))
    figures = meter.figures()
    assert figures.redis_rtt_ms == pytest.approx(23.0)
    assert (figures.rounds, figures.window) == (6, 4)
    assert figures.round_trip_ms_p50 == 104.0 and figures.round_trip_ms_p99 == 105.0  # rounds 2..5 kept
    assert figures.transport_ms_p50 == 44.0 and figures.verify_ms_p50 == 60.0


def test_round_trips_count_per_verdict_and_by_what_they_were_for():
    meter = LinkMeter()
    assert meter.figures().round_trips_per_round is None and meter.figures().round_trips_by_kind == {}
    for _ in range(4):
        meter.observe_verdict()
        meter.count_round_trip(TRIP_BLOCKS)
    meter.count_round_trip(TRIP_BLOCKS)  # a block sent ahead, after the turn's own
    meter.count_round_trip(TRIP_LIVENESS)
    figures = meter.figures()
    assert meter.driver_round_trips == 6
    assert figures.round_trips_per_round == 1.5
    assert figures.round_trips_by_kind == {TRIP_BLOCKS: 1.25, TRIP_LIVENESS: 0.25}
    assert "1.50 Redis round trips per round (blocks 1.25, liveness 0.25)" in figures.describe()
    assert figures.verdicts == 4 and figures.round_trip_counts == {TRIP_BLOCKS: 5, TRIP_LIVENESS: 1}
    assert LinkFigures.from_wire(figures.to_wire()) == figures


def test_the_bench_takes_round_trips_per_verdict_over_a_level_from_the_heartbeats_counts():
    """services/bench/links.py: the differences of the counts since start between two reads; a worker new since
    the first read, or restarted (fewer verdicts than before), counts from zero."""
    from services.bench.links import LinkLevel, links_markdown, trips_between
    from services.link.meter import per_verdict

    def figures(verdicts: int, **counts: int) -> LinkFigures:
        return LinkFigures(verdicts=verdicts, round_trip_counts=counts)

    before = {"a": figures(10, blocks=9, catch_up=2), "b": figures(50, blocks=60)}
    after = {"a": figures(18, blocks=17, catch_up=2, look=1), "b": figures(4, blocks=5), "c": figures(2, open=1)}
    verdicts, trips = trips_between(before, after)
    assert (verdicts, dict(trips)) == (8 + 4 + 2, {"blocks": 8 + 5, "look": 1, "open": 1})
    assert per_verdict(verdicts, trips) == (round(15 / 14, 3), {"blocks": round(13 / 14, 3), "look": 0.071,
                                                               "open": 0.071})
    assert trips_between(after, after) == (0, {}) and per_verdict(0, {}) == (None, {})
    table = links_markdown([LinkLevel(link="20", headline={}, round_trips_per_verdict=1.071)])
    assert "| Redis round trips a verdict | rounds |" in table and "| 1.071 | 0 |" in table


def test_a_heartbeat_carries_link_figures_whole_and_old_heartbeats_still_decode():
    figures = LinkFigures(redis_rtt_ms=20.5, round_trip_ms_p50=90.0, round_trip_ms_p99=120.0, transport_ms_p50=41.0,
                          transport_ms_p99=60.0, verify_ms_p50=49.0, rounds=12, window=12)
    beat = Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu", link=figures)
    assert Heartbeat.decode(beat.encode()).link == figures
    # a worker from before the link figures: no `link` at all
    body = Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu").to_dict()
    del body["link"]
    old = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "heartbeat", "body": body}, use_bin_type=True)
    assert Heartbeat.decode(old).link is None
    # a newer worker's figures with a field this reader does not know: ignored (readers of old code ignore `link`)
    newer = {**beat.to_dict(), "link": {**figures.to_wire(), "jitter_ms_p99": 3.0}}
    packed = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "heartbeat", "body": newer}, use_bin_type=True)
    assert Heartbeat.decode(packed).link == figures
    assert "round trip p50/p99 90.0/120.0 ms" in figures.describe() and "Redis RTT 20.5 ms" in figures.describe()
    assert "Redis RTT - ms" in LinkFigures().describe()


def test_link_messages_round_trip():
    setting = LinkSetting(rtt_ms=20.0, jitter_ms=5.0, set_by="bench")
    assert LinkSetting.decode(setting.encode()) == setting
    status = LinkStatus(name="draft", listen="127.0.0.1:7001", upstream="127.0.0.1:6379", rtt_ms=20, connections=3)
    assert LinkStatus.decode(status.encode()) == status


def test_a_round_trip_starts_where_the_block_was_pushed():
    """The driver passes the time taken before its pipeline ran; the in-flight record keeps it."""
    block = DraftBlock(request_id="r", round=0, num_committed=3, draft_ids=[1])
    flight = InFlight(block, b"", None, sent_at=5.0, sent_wall=1000.0)
    assert (flight.sent_at, flight.sent_wall) == (5.0, 1000.0)


@pytest.mark.parametrize("args, message", [
    (["link", "-5"], "Error: link: '-5': RTT -5 ms is negative"),
    (["link", "fast"], "Error: link: 'fast': RTT 'fast' is not a number of milliseconds"),
    (["link", "20", "--to", "unix:///tmp/r.sock"], "Error: --to: a link forwards TCP to one redis:// server"),
    (["up", "--draft-link", "20:x"], "Error: --draft-link: '20:x': jitter 'x' is not a number"),
    (["up", "--draft-link", "-1"], "Error: --draft-link: '-1': RTT -1 ms is negative"),
    (["up", "--draft-link", "20", "--draft-placement", "local"], "--draft-placement local runs none"),
    (["bench", "--draft-link", "0,abc"], "Error: --draft-link: 'abc': RTT 'abc' is not a number"),
    (["bench", "--draft-link", "20", "--merging"], "not with --merging"),
    (["bench", "--draft-link", "0,20"], "--draft-link: cannot read the stack's Redis at redis://127.0.0.1:1/0"),
    (["bench", "--concurrency", "1", "--link-turns", "3"], "--link-turns 3: takes link levels in turn; give them"),
    (["bench", "--draft-link", "0,20", "--link-turns", "0"], "Invalid value for '--link-turns'"),
])
def test_the_cli_refuses_a_bad_link_before_starting_anything(args, message, monkeypatch):
    from services.config import get_settings

    monkeypatch.setenv("MIRROR_SD_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing may be reached for
    try:
        result = CliRunner().invoke(app, args)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert message in result.output


def _session():
    from services.config import SpeculativeSettings
    from services.engine.draft_session import DraftSession
    from services.protocol import SessionSpec

    spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=16, route="ar")
    return DraftSession(spec, [], drafter=None, speculative=SpeculativeSettings(block_policy="acceptance"),
                        cost=None, reply_to="inbox", pipelined=False)


def _verdict(**timing):
    from services.protocol import Verdict

    return Verdict(request_id="r", round=0, num_committed=5, num_draft_tokens=0, num_accepted=0,
                   committed_ids=[7, 8], num_rounds=2, **timing)


def test_transport_is_measured_on_the_draft_clock_whatever_the_verify_hosts_clock_says():
    """The verify worker's clock is an hour off here: only its duration (60 ms) enters the figure."""
    session = _session()
    block = session.next_block()
    session.sent(block, b"", None, sent_at=100.0, sent_wall=1_000_000.0)
    session.on_verdict(_verdict(worker_id="verify-0", verify_started_at=1_003_600.010,
                                verify_finished_at=1_003_600.070), seen_at=100.1, held_s=0.01)
    assert session.last_trip == RoundTrip(round_trip_ms=pytest.approx(100.0), transport_ms=pytest.approx(30.0),
                                          verify_ms=pytest.approx(60.0))
    assert session.round_trip_ms == [pytest.approx(100.0)] and session.transport_ms == [pytest.approx(30.0)]
    summary = session.summary().to_dict()
    assert summary["transport_ms_p50"] == pytest.approx(30.0) and summary["round_trip_ms_p50"] == pytest.approx(100.0)


def test_a_verdict_without_verify_times_gives_no_figure():
    session = _session()
    session.sent(session.next_block(), b"", None, sent_at=100.0)
    session.on_verdict(_verdict(worker_id=""), seen_at=100.1)  # a resync: read from the stream, no verify time
    assert session.last_trip is None and session.transport_ms == []


def test_a_speculation_says_when_its_drafting_ended_not_when_it_was_read():
    import time

    from services.engine.draft_pipeline import SpeculationState, speculate_many
    from services.speculative.params import SamplingParams
    from tests.unit.test_pipeline import CountingDrafter

    state = SpeculationState(CountingDrafter(), [1, 2, 3], 2, SamplingParams(), None)
    speculate_many([state])
    drafted = time.time()
    time.sleep(0.05)
    speculation = state.result()
    assert speculation.finished_at <= drafted


def exported(beats: list[Heartbeat]) -> str:
    """The gateway's /metrics text with `beats` as the fleet's last heartbeats."""
    from prometheus_client import generate_latest

    from gateway.observability.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.fleet.beats = beats
    return generate_latest(metrics.registry).decode()


def test_metrics_export_a_draft_workers_link_figures_in_seconds():
    figures = LinkFigures(redis_rtt_ms=20.0, round_trip_ms_p50=90.0, round_trip_ms_p99=120.0, transport_ms_p50=41.0,
                          rounds=3, window=3)
    text = exported([Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu", link=figures),
                     Heartbeat(worker_id="verify-0", role="verify", pool="cpu")])
    assert 'mirror_sd:draft_redis_rtt_seconds{pool="cpu",worker="draft-cpu"} 0.02' in text
    assert 'mirror_sd:draft_round_trip_seconds{pool="cpu",quantile="0.99",worker="draft-cpu"} 0.12' in text
    assert 'mirror_sd:draft_transport_seconds{pool="cpu",quantile="0.5",worker="draft-cpu"} 0.041' in text
    assert 'quantile="0.99",worker="draft-cpu"} ' not in text.split("mirror_sd:draft_transport_seconds")[-1]
    assert "verify-0" not in "".join(line for line in text.splitlines() if line.startswith("mirror_sd:draft_"))


def test_a_draft_workers_resent_and_failed_over_blocks_are_counters_in_metrics_and_status():
    quiet, lossy = LinkFigures(rounds=9), LinkFigures(rounds=9, resent_blocks=2, failed_over_blocks=1)
    text = exported([Heartbeat(worker_id="draft-a", role="draft", pool="cpu", link=quiet),
                     Heartbeat(worker_id="draft-b", role="draft", pool="cpu", link=lossy)])
    assert "# TYPE mirror_sd:draft_resent_blocks_total counter" in text
    assert 'mirror_sd:draft_resent_blocks_total{pool="cpu",worker="draft-a"} 0.0' in text
    assert 'mirror_sd:draft_resent_blocks_total{pool="cpu",worker="draft-b"} 2.0' in text
    assert 'mirror_sd:draft_failed_over_blocks_total{pool="cpu",worker="draft-b"} 1.0' in text
    assert "resent" not in quiet.describe()
    assert lossy.describe().endswith("; blocks resent 2, failed over 1")
    assert LinkFigures.from_wire(lossy.to_wire()) == lossy


def test_metrics_export_a_verify_workers_step_counters_bridging_included():
    counters = {"steps": 40, "rows": 90, "tokens": 700, "forward_s": 3.5, "step_s": 3.75, "bridged_rounds": 12,
                "blocks_bridged": 3, "blocks_answered": 1, "wide_steps": 9}
    text = exported([Heartbeat(worker_id="verify-0", role="verify", pool="cpu", step_counters=counters),
                     Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu")])
    assert 'mirror_sd:verify_bridged_rounds_total{pool="cpu",worker="verify-0"} 12.0' in text
    assert 'mirror_sd:verify_wide_steps_total{pool="cpu",worker="verify-0"} 9.0' in text
    assert 'mirror_sd:verify_forward_seconds_total{pool="cpu",worker="verify-0"} 3.5' in text
    assert "# TYPE mirror_sd:verify_steps_total counter" in text
    assert "draft-cpu" not in "".join(line for line in text.splitlines() if line.startswith("mirror_sd:verify_"))
