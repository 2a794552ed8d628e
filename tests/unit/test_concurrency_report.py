"""The concurrency bench's turns: alternating order, each turn's figures, stack over stack-ar turn by turn."""

from __future__ import annotations

from services.bench.concurrency import merge_runs, summarize, turn_order
from services.bench.concurrency_report import paired_ratios, write_markdown
from services.bench.load import LevelRun, StreamRecord


def level_run(mode: str, concurrency: int, tokens: int, wall_s: float) -> LevelRun:
    record = StreamRecord(prompt_id="p", token_ids=[1] * tokens, num_tokens=tokens, ttft_s=0.1, e2e_s=wall_s,
                          chunk_gaps_s=[0.05], finish_reason="length")
    return LevelRun(mode, concurrency, [record], wall_s)


def test_turns_alternate_the_order_of_the_modes():
    modes = ["stack", "stack-ar"]
    assert [turn_order(modes, turn) for turn in range(4)] == [
        ["stack", "stack-ar"], ["stack-ar", "stack"], ["stack", "stack-ar"], ["stack-ar", "stack"]]
    assert turn_order(["stack", "stack-ar", "hf-batch"], 1) == ["hf-batch", "stack-ar", "stack"]
    assert modes == ["stack", "stack-ar"]  # the configured list is left as it was


def test_each_turns_figure_and_the_ratio_turn_by_turn(tmp_path):
    # turn 1 of the stack was slow (the first after the warm-up), the rest matched the plain route
    stack = merge_runs([level_run("stack", 16, 400, 10.0), level_run("stack", 16, 500, 10.0),
                        level_run("stack", 16, 480, 8.0)])
    plain = merge_runs([level_run("stack-ar", 16, 500, 10.0), level_run("stack-ar", 16, 500, 10.0),
                        level_run("stack-ar", 16, 600, 10.0)])
    assert stack.extra["tokens_per_s_runs"] == [40.0, 50.0, 60.0]
    assert stack.wall_s == 28.0 and len(stack.records) == 3
    single = [merge_runs([level_run("stack", 1, 30, 1.0)]), merge_runs([level_run("stack-ar", 1, 20, 1.0)])]
    assert "tokens_per_s_runs" not in single[0].extra  # one turn: nothing to pair
    rows = [summarize(run, 0) for run in (*single, stack, plain)]
    assert paired_ratios(rows, "stack", "stack-ar") == {16: [0.8, 1.0, 1.0]}
    text = write_markdown(tmp_path / "concurrency.md", rows, []).read_text()
    assert "- stack C=16: 40, 50, 60" in text and "- stack-ar C=16: 50, 50, 60" in text
    assert "- stack / stack-ar C=16, turn by turn: 0.8, 1, 1 (median 1)" in text
    assert "C=1:" not in text


def test_a_level_whose_peer_ran_fewer_turns_is_not_paired():
    stack = summarize(merge_runs([level_run("stack", 4, 100, 1.0), level_run("stack", 4, 100, 2.0)]), 0)
    plain = summarize(merge_runs([level_run("stack-ar", 4, 100, 1.0)]), 0)
    assert paired_ratios([stack, plain], "stack", "stack-ar") == {}
