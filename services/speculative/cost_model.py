"""Choosing the block length by cost: expected tokens per millisecond from a measured cost curve.

A round with block length g costs g draft steps plus one target forward over
g + 1 tokens, and yields 1 + alpha + ... + alpha^g tokens on average. Under
load the forward is a step shared with other sessions' rows: its cost is read
off a grid measured over (rows, tokens per row), so a longer block is charged
what it really adds at the current batch. Where the projections are
compute-bound (a CPU past a few rows, a GPU at a large batch) every extra
draft token lengthens the step for all, and plain batched decoding wins. On a
CPU the forward's cost is not smooth in its length (measured here: 1 token
43 ms, 2 tokens 73 ms, 5 tokens 71 ms), so the best g is read off the
measured curve, not assumed. g = 0 (the target alone) competes too: when
no block length pays for itself, the session should not draft. The draft
side is shared as well: one draft worker steps the drafts of all its
sessions together, so a session's draft step costs what the batched step
of all of them costs (measured per session count, like the target's grid).

A remote draft also pays its link: a drafted round waits for its verdict to
cross to the draft worker and its next block to cross back (the measured
transport), except when that block was verified ahead (blocks_ahead > 1,
services/speculative/chaining.py), which needs the whole block and the
draft's guess of the bonus token right: about alpha^(gamma + 1), and enough
blocks ahead to cover the trip and the drafting. Target-only
rounds run on the verify worker alone and pay no link, so a slow enough link
makes gamma 0 win, and shorter blocks, which hold their chain more often,
win sooner than over no link.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.speculative.bound import expected_accepted


def _interpolate(curve: dict[int, float], at: float) -> float:
    """Measured, else linear between the nearest measured points (flat past the last one)."""
    if at in curve:
        return curve[at]
    lower = [n for n in curve if n < at]
    higher = [n for n in curve if n > at]
    if not lower:
        return curve[min(higher)]
    below = max(lower)
    if not higher:
        return curve[below]
    above = min(higher)
    return curve[below] + (at - below) / (above - below) * (curve[above] - curve[below])


def _interpolate_rows(at_rows: dict[int, float], rows: float) -> float:
    """A cost measured at some row counts (1 among them): linear between them, and past the largest
    measured along the slope of the last two (a batched step keeps growing with its rows)."""
    if rows in at_rows:
        return at_rows[rows]
    counts = sorted(at_rows)
    if len(counts) == 1:
        return at_rows[counts[0]]
    higher = [count for count in counts if count > rows]
    below = max(count for count in counts if count < rows)
    above = min(higher) if higher else below
    if not higher:
        below = counts[-2]
    slope = (at_rows[above] - at_rows[below]) / (above - below)
    return at_rows[below] + (rows - below) * slope


def nondecreasing(curve: dict[int, float]) -> dict[int, float]:
    """A measured cost curve made nondecreasing in its size: each point at most what every larger one cost."""
    cleaned, bound = {}, float("inf")
    for size in sorted(curve, reverse=True):
        bound = min(bound, curve[size])
        cleaned[size] = bound
    return dict(sorted(cleaned.items()))


def clean_grid(verify_ms: dict[int, float], step_ms: dict[int, dict[int, float]]) -> tuple[dict, dict]:
    """The plain-decoding cells of a measured grid (one token per row) made consistent: at most what any
    longer step of the same rows cost, and nondecreasing in rows (the one-row curve counts as rows 1).

    A profile is timed while the rest of a stack starts, and noise only adds time: a plain cell measured
    high makes speculation look cheaper than plain decoding, which is the one mistake the cost policy
    must not make. Cells of longer rows stay as measured: on CPUs they are uneven for real (a block of 5
    tokens can cost less than one of 3: other kernels), and the policy picks its blocks by them."""
    curves = {1: dict(verify_ms), **{rows: dict(curve) for rows, curve in step_ms.items()}}
    for curve in curves.values():
        if 1 in curve:
            curve[1] = min(curve.values())
    plain = nondecreasing({rows: curve[1] for rows, curve in curves.items() if 1 in curve})
    for rows, ms in plain.items():
        curves[rows][1] = ms
    return curves.pop(1), curves


@dataclass(frozen=True)
class CostModel:
    verify_ms: dict[int, float]  # tokens in one target forward of one row -> ms (measured; at least 1 token)
    draft_ms_per_token: float = 0.0
    # rows in the step -> {tokens per row -> ms}, for steps of more than one row (measured; empty = batch 1 only)
    step_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    # sessions drafting together -> ms of one batched draft step (one token each), for more than one session
    # (measured on model drafts; empty = every session pays draft_ms_per_token, as if it had a core of its own)
    draft_step_ms: dict[int, float] = field(default_factory=dict)
    # pipelined drafting (a remote draft worker) also drafts a guess of the bonus token each round; a verify
    # worker drafting for its own sessions between its forwards does not pipeline, so it drafts no guess
    pipelined: bool = True
    # what a round costs beyond its forwards and draft steps (building rows, the round math, commits,
    # publishing): measured live by a verify worker drafting for its own sessions, 0 for a profile alone
    round_overhead_ms: float = 0.0
    # the draft's prefill of the prompts it reads, per output token (a verify worker drafting for its own
    # sessions pays it in its turns, holding every row of the step; 0 for a draft worker, on its own cores)
    draft_prefill_ms_per_token: float = 0.0
    # a remote draft's link: what a drafted round waits beyond verification when its next block was not
    # verified ahead (the measured transport: both ways over the link and the queues), and how many blocks
    # the draft keeps at its verify worker (> 1: a block accepted whole with the bonus guessed hides the link)
    link_ms: float = 0.0
    blocks_ahead: int = 1
    # a target-only step where it runs on more threads than a drafted round's (one box: while no draft drafts, the
    # verify worker takes the draft worker's idle core, worker.wide_threads): one-token rows -> ms, measured by the
    # verify worker at start-up (services/engine/wide_steps.py); empty = the grid's, as on a verify host of its own
    plain_ms: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if 1 not in self.verify_ms:
            raise ValueError("a cost model needs the 1-token verify cost")
        curves = [self.verify_ms, *self.step_ms.values()]
        if any(n < 1 or ms <= 0 for curve in curves for n, ms in curve.items()) or any(r < 2 for r in self.step_ms):
            raise ValueError(f"step costs must be positive, for >= 1 token, and rows > 1: {self.verify_ms} "
                             f"{self.step_ms}")
        if self.plain_ms and (1 not in self.plain_ms or any(r < 1 or ms <= 0 for r, ms in self.plain_ms.items())):
            raise ValueError(f"plain step costs need one row's, and must be positive: {self.plain_ms}")

    @classmethod
    def from_profile(cls, profile: dict, draft_ms_per_token: float | None = None,
                     pipelined: bool = True) -> "CostModel | None":
        """From a device profile: {"verify_ms_1": ..., "verify_ms_9": ..., "step_ms_16x5": ...,
        "draft_ms_per_token": ...} (verify_ms_<n>: one row of n tokens; step_ms_<rows>x<n>: rows of n)."""
        verify = {int(key.rsplit("_", 1)[1]): float(value) for key, value in profile.items()
                  if key.startswith("verify_ms_")}
        if 1 not in verify:
            return None
        step: dict[int, dict[int, float]] = {}
        for key, value in profile.items():
            if key.startswith("step_ms_"):
                rows, tokens = (int(part) for part in key.removeprefix("step_ms_").split("x"))
                if rows > 1:
                    step.setdefault(rows, {})[tokens] = float(value)
        plain = {int(key.removeprefix("plain_ms_")): float(value) for key, value in profile.items()
                 if key.startswith("plain_ms_")}
        draft = draft_ms_per_token if draft_ms_per_token is not None else profile.get("draft_ms_per_token", 0.0)
        draft_steps = {int(key.removeprefix("draft_step_ms_")): float(value) for key, value in profile.items()
                       if key.startswith("draft_step_ms_") and int(key.removeprefix("draft_step_ms_")) > 1}
        verify, step = clean_grid(verify, step)
        if draft and draft_steps:  # a batched draft step never costs less than one session's
            draft_steps = {sessions: max(ms, float(draft)) for sessions, ms in
                           nondecreasing({1: float(draft), **draft_steps}).items() if sessions > 1}
        return cls(verify, float(draft), step, draft_steps, pipelined, plain_ms=plain if 1 in plain else {})

    def verify_cost(self, num_tokens: float) -> float:
        """One row of num_tokens: measured, else linear between the nearest measured lengths (flat past the
        longest); a fractional length (a mean block) interpolates too."""
        if num_tokens < 1:
            raise ValueError(f"a forward covers at least 1 token, got {num_tokens}")
        return _interpolate(self.verify_ms, num_tokens)

    def step_cost(self, rows: float, tokens_per_row: float) -> float:
        """A step of `rows` rows of tokens_per_row each: the row curves measured at the nearest row counts,
        linear in rows between them and extrapolated linearly past the largest measured."""
        if rows <= 1 or not self.step_ms:  # no grid measured: the one-row curve (no load information)
            return self.verify_cost(tokens_per_row)
        curves = {1: self.verify_ms, **self.step_ms}
        return _interpolate_rows({count: _interpolate(curve, tokens_per_row) for count, curve in curves.items()},
                                 rows)

    def plain_cost(self, rows: float = 1) -> float:
        """A target-only step of `rows` one-token rows: plain_ms where measured (linear between its row counts, and
        past the largest in the grid's proportion), never more than the grid's."""
        grid = self.step_cost(rows, 1)
        if not self.plain_ms:
            return grid
        largest = max(self.plain_ms)
        if rows <= largest:
            return min(grid, _interpolate_rows(self.plain_ms, rows))
        return min(grid, self.plain_ms[largest] * grid / self.step_cost(largest, 1))

    def draft_cost(self, sessions: float = 1) -> float:
        """Ms of one draft step when `sessions` sessions draft together on one draft worker: a session's
        block waits for the whole batched step (one llama_decode or packed forward for all of them)."""
        if sessions <= 1 or not self.draft_step_ms:
            return self.draft_ms_per_token
        return _interpolate_rows({1: self.draft_ms_per_token, **self.draft_step_ms}, sessions)

    def round_ms(self, gamma: int, rows: float = 1, draft_sessions: float | None = None,
                 alpha: float | None = None) -> float:
        """One round of one session: the drafting it waits for (a step shared with draft_sessions sessions, default
        the rows) plus the target step it shares with `rows` rows of gamma + 1 (a target-only one: plain_cost),
        plus the round's overhead. With `alpha`, a pipelined draft alone waits only for what its speculation did
        not hide (drafting_ms)."""
        if not gamma:
            return self.plain_cost(rows) + self.round_overhead_ms
        sessions = rows if draft_sessions is None else draft_sessions
        return self.drafting_ms(gamma, sessions, alpha) + self.step_cost(rows, gamma + 1) + self.round_overhead_ms

    def drafting_ms(self, gamma: int, sessions: float = 1, alpha: float | None = None) -> float:
        """The drafting a round of gamma draft tokens waits for. Pipelined drafting drafts the next block (after a
        guess of the bonus token) while this one is verified. When the draft worker serves several sessions its
        core is busy all the while, and every step it drafts is paid, the guess too (measured: at 8 sessions,
        blocks of 2 predicted 1.04x plain decoding without the guess, and gave 0.89x). Alone, with `alpha`: when
        the block is accepted whole and the bonus guessed (about alpha^(gamma + 1)) the next block was drafted
        during the verification and only what outlasted it is waited for; else it is drafted after the verdict
        (measured on one box with the built-in pair: without this the model put the drafted round at 35-39 ms a
        token at RTT 0, where it ran at 30-33)."""
        step = self.draft_cost(sessions)
        if not self.pipelined:
            return gamma * step
        if sessions > 1:
            return (gamma + 1) * step
        if alpha is None:
            return gamma * step
        hit = alpha ** (gamma + 1)
        outlasting = max(0.0, (gamma + 1) * step - self.step_cost(1, gamma + 1))
        return (1.0 - hit) * gamma * step + hit * outlasting

    def tokens_per_ms(self, alpha: float, gamma: int, rows: float = 1, draft_sessions: float | None = None) -> float:
        """Expected tokens per ms of one session whose step has `rows` rows like its own; drafting also pays
        the draft's prefill of every row's tokens (draft_prefill_ms_per_token)."""
        tokens = 1.0 + expected_accepted(alpha, gamma)
        prefill = rows * tokens * self.draft_prefill_ms_per_token if gamma else 0.0
        return tokens / (self.round_ms(gamma, rows, draft_sessions, alpha) + prefill
                         + self.exposed_link_ms(alpha, gamma, rows, draft_sessions))

    def exposed_link_ms(self, alpha: float, gamma: int, rows: float = 1,
                        draft_sessions: float | None = None) -> float:
        """The link a round of gamma drafted tokens waits for on average (0 for target-only rounds): all of it
        when the chain breaks; when it holds (about alpha^(gamma + 1)), what `blocks_ahead` blocks do not cover.
        A block goes out once the verdict of the one blocks_ahead before it is heard, so blocks come no faster
        than one per (link + drafting a block and its bonus guess + verifying it) / blocks_ahead
        (services/speculative/chaining.py), however fast a round that finds its block waiting runs."""
        if not gamma or self.link_ms <= 0:
            return 0.0
        if self.blocks_ahead <= 1:
            return self.link_ms
        hidden = alpha ** (gamma + 1)
        sessions = rows if draft_sessions is None else draft_sessions
        verify = self.step_cost(rows, gamma + 1) + self.round_overhead_ms
        cycle = (self.link_ms + (gamma + 1) * self.draft_cost(sessions) + verify) / self.blocks_ahead
        uncovered = max(0.0, cycle - verify - self.drafting_ms(gamma, sessions, 1.0))
        return self.link_ms * (1.0 - hidden) + hidden * uncovered


def cost_curve_bound(alpha: float, gamma: float, cost: "CostModel") -> float:
    """The Leviathan bound with this machine's measured verify cost instead of "verifying gamma + 1
    tokens costs one forward": (1 + E[accepted]) / ((gamma d + v(gamma + 1)) / v(1)). measured/this is
    the system's own efficiency, the verify curve taken as given."""
    return (1.0 + expected_accepted(alpha, gamma)) * cost.verify_cost(1) / (
        gamma * cost.draft_ms_per_token + cost.verify_cost(gamma + 1))


def best_block_length(alpha: float, cost: CostModel, candidates: Iterable[int], rows: float = 1,
                      draft_sessions: float | None = None) -> tuple[int, float]:
    """The block length (0 = target alone) with the most expected tokens per ms when the step has `rows`
    rows (the load: every row is assumed to draft alike, so at a large batch the extra tokens of every
    row are paid for in a step that is longer for all), and its predicted speedup over the target alone
    at that load. Ties go to the shorter block (less wasted work)."""
    baseline = cost.tokens_per_ms(alpha, 0, rows)
    best_gamma, best_rate = 0, baseline
    for gamma in sorted(set(candidates)):
        rate = cost.tokens_per_ms(alpha, gamma, rows, draft_sessions)
        if rate > best_rate * (1 + 1e-9):
            best_gamma, best_rate = gamma, rate
    return best_gamma, best_rate / baseline


def alpha_from_rounds(rounds: Iterable[tuple[int, int]]) -> float | None:
    """Maximum-likelihood per-token acceptance from (drafted, accepted) rounds: every accepted token
    is a success, a round that stopped early ends in one failure."""
    successes = failures = 0
    for drafted, accepted in rounds:
        successes += accepted
        failures += 1 if accepted < drafted else 0
    total = successes + failures
    return successes / total if total else None
