"""The mutant catalogue: each planted bug with where it shows and how lossy it is.

`cells(session)` picks, from the gate's own cells (`losscheck.cells.cells_for`), those where
the bug manifests, in the order the mutant tier runs them (exact-mode cells on the small target
first: cheapest, and they carry a predicted power).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from losscheck.engine import Engine
from losscheck.matrix import Cell
from losscheck.mutants import engines as planted
from losscheck.mutants import laws
from losscheck.mutants.drafters import TRUNCATION_WIDTH

GREEDY_ARG, SAMPLING_ARGS = "greedy_cell", ("exact_cell", "sampling_cell")
FAMILY_A = ("A", "self")  # the bundled family-A drafter and the self-draft oracle (also family A)


@dataclass(frozen=True)
class Mutant:
    name: str
    engine: type[Engine]  # called as engine(target, drafter, k, width), like `Engine`
    kind: str  # "greedy" | "sampling": which gate tests must catch it
    description: str  # why it is lossy, and where it shows
    manifests: Callable[[Cell, int], bool]  # (cell, generated tokens the cell tests) -> bug visible?
    first_token: Callable[[laws.FirstSlot], torch.Tensor] | None = None  # exact law of token 0
    no_law: str = ""  # why there is no first-token law (predicted power n/a)

    @property
    def bug_class(self) -> str:
        """The real bug class it models: the first line of the engine's docstring."""
        return inspect.getdoc(self.engine).splitlines()[0]

    def cells(self, session) -> list[Cell]:
        """The gate cells of `session` where the bug manifests, in run order."""
        from losscheck.cells import cells_for

        profile = session.options.profile
        args = (GREEDY_ARG,) if self.kind == "greedy" else SAMPLING_ARGS
        return [
            c for arg in args for c in cells_for(session, arg)
            if self.manifests(c, profile.exact_horizon if c.target == "small" else profile.horizon)
        ]


def _sampled(drafters: tuple[str, ...] = ("A",)) -> Callable[[Cell, int], bool]:
    return lambda cell, horizon: not cell.params.greedy and cell.drafter in drafters


def _greedy(drafters: tuple[str, ...] = ("A",)) -> Callable[[Cell, int], bool]:
    return lambda cell, horizon: cell.params.greedy and cell.drafter in drafters


def _tempered(cell: Cell, horizon: int) -> bool:
    return _sampled()(cell, horizon) and cell.params.temperature != 1.0


def _truncated(cell: Cell, horizon: int) -> bool:
    return _sampled()(cell, horizon) and (cell.params.top_k > 0 or cell.params.top_p < 1.0)


def _more_candidates_than_drafted(cell: Cell, horizon: int) -> bool:
    # With top-k <= w the drafter's top-w candidates are all of q: nothing is truncated.
    return _sampled(FAMILY_A)(cell, horizon) and not 0 < cell.params.top_k <= TRUNCATION_WIDTH


def _bonus_in_horizon(cell: Cell, horizon: int) -> bool:
    # The first bonus is the (k+1)-th token; later bonuses only come later.
    return _sampled(FAMILY_A)(cell, horizon) and cell.k < horizon


FIRST_SLOT_UNTOUCHED = "the first token comes from slot 0, which this bug leaves exact"

CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "unnormalised_residual", planted.UnnormalisedResidual, "sampling",
        "After a rejection (probability β = Σ max(0, p - q)) the inverse-CDF draw on the unnormalised "
        "residual overshoots its mass with probability 1 - β and emits the last id. Shows wherever the "
        "drafter is rejected: every family-A sampling cell.",
        _sampled(), laws.unnormalised_residual,
    ),
    Mutant(
        "residual_is_p", planted.ResidualIsP, "sampling",
        "Accepted drafts already give min(p, q); resampling rejections from p adds β·p, over-emitting "
        "tokens where q > p by β·p - max(0, p - q). Distortion scales with the rejection rate β.",
        _sampled(), laws.residual_is_p,
    ),
    Mutant(
        "inverted_ratio", planted.InvertedRatio, "sampling",
        "min(1, q/p) keeps every over-drafted token (q > p) and thins the under-drafted ones, the "
        "opposite of the correction; the residual then cannot make up the difference.",
        _sampled(), laws.inverted_ratio,
    ),
    Mutant(
        "temperature_p_only", planted.TemperatureOnPOnly, "sampling",
        "Drafts come from q_T but the verifier divides by q_1: at T < 1 likely drafts look rarer than "
        "they were and are over-accepted, at T > 1 the reverse. Lossless at T = 1 (q_T = q_1).",
        _tempered, laws.temperature_p_only,
    ),
    Mutant(
        "temperature_q_only", planted.TemperatureOnQOnly, "sampling",
        "Rejection sampling is exact for whatever p it is given, so the output follows the untempered "
        "p_1 instead of p_T. Lossless at T = 1.",
        _tempered, laws.temperature_q_only,
    ),
    Mutant(
        "truncation_draft_only", planted.TruncationOnDraftOnly, "sampling",
        "The verifier's p keeps the tokens top-k / top-p cut, so the output follows the untruncated "
        "distribution and emits tokens of target probability 0. Shows in the top-k / top-p cells.",
        _truncated, laws.truncation_draft_only,
    ),
    Mutant(
        "greedy_draft_softmax_q", planted.GreedyDraftSoftmaxQ, "sampling",
        "An argmax draft has q = δ(x); judged against softmax q(x) < 1 it is accepted with "
        "min(1, p(x)/q(x)) instead of p(x), over-emitting the draft's argmax. The self-draft oracle "
        "then accepts every draft and emits only argmaxes.",
        _sampled(FAMILY_A), laws.greedy_draft_softmax_q,
    ),
    Mutant(
        "truncated_candidates_full_q", planted.TruncatedCandidatesFullQ, "sampling",
        "Drafts only ever come from the top-4 candidates, but q reports mass on the rest, so the "
        "residual max(0, p - q) gives the tail back only what p exceeds q by: tail tokens are "
        "under-emitted by about their q mass. Shows where q has more than 4 candidates (not top-k <= 4).",
        _more_candidates_than_drafted, laws.truncated_candidates_full_q,
    ),
    Mutant(
        "bonus_from_wrong_slot", planted.BonusFromWrongSlot, "sampling",
        "After k accepted drafts the bonus is drawn from p(· | prefix) without the last accepted draft. "
        "Shows in every family-A sampling cell whose tested horizon reaches the first bonus (k < L).",
        _bonus_in_horizon, None, FIRST_SLOT_UNTOUCHED + " (the bonus is token k+1)",
    ),
    Mutant(
        "recovered_after_rejected", planted.RecoveredAfterRejected, "sampling",
        "At the first rejection the emitted token is drawn from p after the rejected draft, i.e. "
        "conditioned on a token that was never emitted (greedy: argmax of the next slot).",
        _sampled(), laws.recovered_after_rejected,
    ),
    Mutant(
        "shared_uniform", planted.SharedUniform, "sampling",
        "One uniform u drives all acceptance tests and the recovered draw. A rejection means u >= "
        "min(1, p/q), so the inverse-CDF recovered draw sees only the top of the residual's CDF; the "
        "slots' acceptances are also correlated. (Reusing u for acceptance alone is a second-order "
        "effect, ~β², too small to plant as a realistic must-catch bug.)",
        _sampled(), laws.shared_uniform,
    ),
    Mutant(
        "typical_acceptance", planted.TypicalAcceptance, "sampling",
        "Drafts with p(x) above min(0.09, 0.3·e^-H(p)) pass outright and rejections resample from p, "
        "so low-probability tokens are under-emitted — even for the self-draft oracle.",
        _sampled(FAMILY_A), laws.typical,
    ),
    Mutant(
        "bonus_counted_not_written", planted.BonusCountedNotWritten, "greedy",
        "Whenever a row accepts all k drafts it emits the placeholder id 0 where the bonus belongs "
        "(both decoding modes). Shows in every family-A greedy cell, the oracle's included.",
        _greedy(FAMILY_A), None, "greedy cells are deterministic: any divergence fails",
    ),
    Mutant(
        "stale_target_cache", planted.StaleCache, "greedy",
        "Rejected drafts' keys/values stay in the target's context and positions drift. Shows where "
        "drafts are rejected: the family-A greedy cells (the oracle never rejects).",
        _greedy(), None, "greedy cells are deterministic: any divergence fails",
    ),
    Mutant(
        "batch_max_positions", planted.BatchMaxPositions, "greedy",
        "Rows that accepted fewer drafts than the batch's best get positions ahead of their cache, "
        "shifting rotary phases. Shows where rows accept different counts: family-A greedy cells.",
        _greedy(), None, "greedy cells are deterministic: any divergence fails",
    ),
    Mutant(
        "rows_mixed_up", planted.RowsMixedUp, "greedy",
        "A row commits another row's tokens whenever rows accept different counts (both decoding "
        "modes). Shows in the family-A greedy cells (the oracle's rows all accept k).",
        _greedy(), None, "greedy cells are deterministic: any divergence fails",
    ),
)

BY_NAME = {m.name: m for m in CATALOGUE}
