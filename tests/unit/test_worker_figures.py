"""The verify worker's per-token latency counts running streams, not prompts being prefilled."""

from verify_worker.figures import WorkerFigures


def test_prefill_is_time_to_first_token_not_a_per_token_latency():
    figures = WorkerFigures()
    # a lone 150-token prompt prefilled: 400 ms, its first token committed; no stream was waiting
    figures.record_step(rows=1, tokens=150, forward_s=0.39, step_s=0.4, streaming_rows=0, streamed=0)
    assert figures.heartbeat_fields()["latency_p99_ms"] is None
    assert figures.counters.steps == 1 and figures.counters.tokens == 150
    # two streams verify blocks beside a prompt chunk: 120 ms for 2 rows that committed 6 tokens
    figures.record_step(rows=3, tokens=80, forward_s=0.11, step_s=0.12, streaming_rows=2, streamed=6)
    fields = figures.heartbeat_fields()
    assert fields["latency_p50_ms"] == fields["latency_p99_ms"] == 1000 * 0.12 * 2 / 6
    assert fields["batch_rows"] == 2.0


def test_the_latency_rule_reads_steps_another_session_shared():
    """A lone stream's step is per-token latency, but no sign of load (telemetry/rules.py): only steps of two rows
    or more (another stream, a prompt's chunk) go into latency_p99_shared_ms."""
    figures = WorkerFigures()
    figures.record_step(rows=1, tokens=14, forward_s=0.25, step_s=0.26, streaming_rows=1, streamed=1)
    fields = figures.heartbeat_fields()
    assert fields["latency_p99_ms"] == 260.0 and fields["latency_p99_shared_ms"] is None
    figures.record_step(rows=2, tokens=2, forward_s=0.05, step_s=0.06, streaming_rows=2, streamed=2)
    fields = figures.heartbeat_fields()
    assert fields["latency_p99_shared_ms"] == 60.0 and fields["latency_p99_ms"] == 260.0
