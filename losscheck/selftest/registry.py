"""The mutant catalogue: each planted bug, what it plants and where it shows.

A mutant plants its bug in the speculative engine only — as the engine's verifier, as a wrapper
around the drafter (a misreported q) or around the target (cache and position bookkeeping), as
its prefix cache or as its continuous-batching scheduler (`losscheck.selftest.serving`) — so
the drafter-less baseline the greedy gate compares against stays plain decoding. `cells` picks,
from the gate's own plan (`losscheck.plan.matrix.plan`), the cells where the bug manifests, in the order
the mutant tier runs them (exact-mode cells on the small target first: cheapest, and they carry a
predicted power).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import EndRule
from losscheck.core.history import HistoryStep
from losscheck.core.logprobs import LogprobRule
from losscheck.core.stops import StopRule
from losscheck.core.verify import Verifier
from losscheck.plan.matrix import EXACT_CELL, GREEDY_CELL, ORACLE, PIT_CELL, Cell
from losscheck.plan.profiles import Profile
from losscheck.selftest import drafters as planted
from losscheck.selftest import end_bugs, history_bugs, laws, logprob_bugs, serving, targets
from losscheck.selftest import verifiers as bugs
from losscheck.selftest.drafters import TRUNCATION_WIDTH
from losscheck.serving.batching import ContinuousBatcher
from losscheck.serving.prefix_cache import PrefixCache

FAMILY_A = ("A", ORACLE)  # the bundled family-A drafter and the self-draft oracle (also family A)


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str  # "greedy" | "sampling": which gate tests must catch it
    bug_class: str  # the real bug class it models
    description: str  # why it is lossy, and where it shows
    manifests: Callable[[Cell, int], bool]  # (cell, generated tokens the cell tests) -> bug visible?
    first_token: Callable[[laws.FirstSlot], torch.Tensor] | None = None  # exact law of token 0
    no_law: str = ""  # why there is no first-token law (predicted power n/a)
    # what it plants (`losscheck.run.plant.Plant`): None leaves the part as it is
    verifier: Verifier | None = None
    wrap_drafter: Callable[[Drafter], Drafter] | None = None
    wrap_target: Callable[[Target, int], Target] | None = None  # (target, k) -> target
    prefix_cache: Callable[[PrefixCache], PrefixCache] | None = None  # the cell's prefix cache -> planted one
    scheduler: type[ContinuousBatcher] | None = None  # a planted continuous-batching scheduler
    history: HistoryStep | None = None  # the engine's history-dependent processing of p (`losscheck.core.history`)
    ends: EndRule | None = None  # the engine's rule for where a round's rows end (`losscheck.core.engine`)
    logprobs: LogprobRule | None = None  # the engine's reported log-probabilities (`losscheck.core.logprobs`)
    stop_rule: StopRule | None = None  # the engine's token that completes a stop string (`losscheck.core.stops`)

    def cells(self, plan: Mapping[str, list[Cell]], profile: Profile, stress: bool = True) -> list[Cell]:
        """The cells of a gate `plan` where the bug manifests, in run order (`stress` False:
        without the stress cells)."""
        args = (GREEDY_CELL,) if self.kind == "greedy" else (EXACT_CELL, PIT_CELL)
        return [
            c
            for arg in args
            for c in plan[arg]
            if self.manifests(c, profile.exact_horizon if c.target == "small" else profile.pit_horizon(c.k))
            and (stress or c.stress is None)
        ]


def _sampled(drafters: tuple[str, ...] = ("A",)) -> Callable[[Cell, int], bool]:
    return lambda cell, horizon: not cell.params.greedy and cell.drafter in drafters


def _greedy(drafters: tuple[str, ...] = ("A",)) -> Callable[[Cell, int], bool]:
    return lambda cell, horizon: cell.params.greedy and cell.drafter in drafters


def _serving(**axis: str) -> Callable[[Cell, int], bool]:
    """Greedy cells of family A with the serving axes `axis` (e.g. prefix="warm")."""
    return lambda cell, horizon: _greedy()(cell, horizon) and all(cell.axis(f) == v for f, v in axis.items())


def _main_sampled(cell: Cell, horizon: int) -> bool:
    return _sampled()(cell, horizon) and cell.target == "main"


def _with_stop_ids(cell: Cell, horizon: int) -> bool:  # where ends inside a block can leak
    return _sampled()(cell, horizon) and bool(cell.params.stop_ids)


def _with_stop_strings(cell: Cell, horizon: int) -> bool:  # where a string spans tokens and rounds
    return _sampled()(cell, horizon) and cell.params.stop_strings is not None


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


def _history(*knobs: str) -> Callable[[Cell, int], bool]:
    """Family-A sampling cells whose parameters turn on one of `knobs`: "penalties" or a
    `SamplingParams` field (min_p, logit_bias, banned_ids, min_tokens)."""

    def on(cell: Cell, horizon: int) -> bool:
        params = cell.params
        return _sampled()(cell, horizon) and any(
            params.penalised if knob == "penalties" else bool(getattr(params, knob)) for knob in knobs
        )

    return on


def _slot_drafted(slot: int) -> Callable[[Cell, int], bool]:
    """Family-A sampling cells whose rounds draft slot `slot` (k > slot)."""
    return lambda cell, horizon: _sampled()(cell, horizon) and cell.k > slot


INTERMITTENT_SHARE = 0.3  # residual_is_p_on_30pct_of_rounds
BONUS_SHARE = 0.25  # bonus_from_wrong_slot_on_25pct_of_rounds
STALE_SHARE = 0.3  # stale_q_on_30pct_of_rounds
ROW_EVERY = 4  # residual_is_p_one_row_in_4
SLOT = 1  # residual_is_p_at_slot_1
SMALL_MISREPORT = 2.0  # one_id_underreported_2x

GREEDY_NO_LAW = "greedy cells are deterministic: any divergence fails"
HISTORY_NO_LAW = "the exact first-token laws model the history-free processing only"
LOGPROB_NO_LAW = "the bug changes the reported logprobs, not any token's law"
FIRST_SLOT_UNTOUCHED = "the first token comes from slot 0, which this bug leaves exact"

CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "unnormalised_residual",
        "sampling",
        "Residual not normalised: inverse-CDF on max(0, p - q), so the missing mass lands on the last id.",
        "After a rejection (probability β = Σ max(0, p - q)) the inverse-CDF draw on the unnormalised "
        "residual overshoots its mass with probability 1 - β and emits the last id. Shows wherever the "
        "drafter is rejected: every family-A sampling cell.",
        _sampled(),
        laws.unnormalised_residual,
        verifier=bugs.in_sampled_rounds(bugs.verify_unnormalised_residual),
    ),
    Mutant(
        "residual_is_p",
        "sampling",
        "Wrong residual: the recovered token is drawn from p instead of norm(max(0, p - q)).",
        "Accepted drafts already give min(p, q); resampling rejections from p adds β·p, over-emitting "
        "tokens where q > p by β·p - max(0, p - q). Distortion scales with the rejection rate β.",
        _sampled(),
        laws.residual_is_p,
        verifier=bugs.in_sampled_rounds(bugs.verify_residual_is_p),
    ),
    Mutant(
        "residual_is_p_on_30pct_of_rounds",
        "sampling",
        "Intermittent wrong residual: on 30% of each row's rounds (independently) the recovered token is "
        "drawn from p instead of norm(max(0, p - q)).",
        "A bug some rounds hit and others miss (a race on the residual buffer, a fallback path): the "
        "emitted token's law is the mixture 0.7·p + 0.3·p'_residual_is_p, a member of the residual_is_p "
        "family below its catalogue point.",
        _sampled(),
        laws.on_share(laws.residual_is_p, INTERMITTENT_SHARE),
        verifier=bugs.in_sampled_rounds(bugs.on_share_of_rounds(bugs.verify_residual_is_p, INTERMITTENT_SHARE)),
    ),
    Mutant(
        "residual_is_p_one_row_in_4",
        "sampling",
        "Wrong residual at some batch positions: rows 0, 4, 8, … of each verify call recover from p.",
        "A batched kernel that indexes the residual wrongly for one row in four: those rows follow the "
        "residual_is_p law, the others are exact — a quarter of the rows, fixed by batch position.",
        _sampled(),
        None,
        "the first token's law depends on the row's batch position",
        verifier=bugs.in_sampled_rounds(bugs.at_batch_positions(bugs.verify_residual_is_p, ROW_EVERY)),
    ),
    Mutant(
        "residual_is_p_at_slot_1",
        "sampling",
        "Wrong residual at one slot: a rejection at draft slot 1 recovers from p; every other slot is exact.",
        "A slot-indexed bug (an off-by-one in the per-slot residual buffer): only rounds whose first "
        "rejection falls on slot 1 emit from p — a share of the tokens the slot-stratified tests see.",
        _slot_drafted(SLOT),
        None,
        FIRST_SLOT_UNTOUCHED,
        verifier=bugs.in_sampled_rounds(bugs.at_slot(bugs.verify_residual_is_p, SLOT)),
    ),
    Mutant(
        "inverted_ratio",
        "sampling",
        "Acceptance ratio inverted: drafts kept with probability min(1, q/p).",
        "min(1, q/p) keeps every over-drafted token (q > p) and thins the under-drafted ones, the "
        "opposite of the correction; the residual then cannot make up the difference.",
        _sampled(),
        laws.inverted_ratio,
        verifier=bugs.in_sampled_rounds(bugs.verify_inverted_ratio),
    ),
    Mutant(
        "temperature_p_only",
        "sampling",
        "Processors applied to p but not q: the drafter samples at temperature T but reports its q at T = 1.",
        "Drafts come from q_T but the verifier divides by q_1: at T < 1 likely drafts look rarer than "
        "they were and are over-accepted, at T > 1 the reverse. Lossless at T = 1 (q_T = q_1).",
        _tempered,
        laws.temperature_p_only,
        wrap_drafter=planted.misreporting(planted.untempered_report, "q-at-T1", "temperature_p_only"),
    ),
    Mutant(
        "temperature_q_only",
        "sampling",
        "Processors applied to q but not p: the verifier's target distribution skips the temperature.",
        "Rejection sampling is exact for whatever p it is given, so the output follows the untempered "
        "p_1 instead of p_T. Lossless at T = 1.",
        _tempered,
        laws.temperature_q_only,
        verifier=bugs.verify_temperature_on_q_only,
    ),
    Mutant(
        "greedy_at_any_temperature",
        "sampling",
        "Silent greedy fallback: verification returns the target's argmax at T > 0 (SGLang on some "
        "backends, mistral.rs).",
        "Drafts are kept iff they are the argmax and every recovered or bonus token is the argmax, so "
        "every sampled cell emits the greedy path: each token is its top token, which the target gives "
        "probability p_max < 1. Caught by pit.greedy_fallback (named) as well as the pooled PIT tests.",
        _sampled(),
        laws.greedy_at_any_temperature,
        verifier=bugs.verify_greedy_at_any_temperature,
    ),
    Mutant(
        "truncation_draft_only",
        "sampling",
        "vLLM-style: top-k / top-p applied to the draft side only (the target's p left untruncated).",
        "The verifier's p keeps the tokens top-k / top-p cut, so the output follows the untruncated "
        "distribution and emits tokens of target probability 0. Shows in the top-k / top-p cells.",
        _truncated,
        laws.truncation_draft_only,
        verifier=bugs.verify_truncation_on_draft_only,
    ),
    Mutant(
        "greedy_draft_softmax_q",
        "sampling",
        "Greedy draft verified with the drafter's softmax as q instead of the point mass.",
        "An argmax draft has q = δ(x); judged against softmax q(x) < 1 it is accepted with "
        "min(1, p(x)/q(x)) instead of p(x), over-emitting the draft's argmax. The self-draft oracle "
        "then accepts every draft and emits only argmaxes.",
        _sampled(FAMILY_A),
        laws.greedy_draft_softmax_q,
        wrap_drafter=planted.misreporting(
            planted.argmax_with_softmax_report, "argmax-softmax-q", "greedy_draft_softmax_q"
        ),
    ),
    Mutant(
        "truncated_candidates_full_q",
        "sampling",
        "Top-w truncated candidates reported with the untruncated q (w = 4).",
        "Drafts only ever come from the top-4 candidates, but q reports mass on the rest, so the "
        "residual max(0, p - q) gives the tail back only what p exceeds q by: tail tokens are "
        "under-emitted by about their q mass. Shows where q has more than 4 candidates (not top-k <= 4).",
        _more_candidates_than_drafted,
        laws.truncated_candidates_full_q,
        wrap_drafter=planted.misreporting(planted.top_w_with_full_report, "top4-full-q", "truncated_candidates_full_q"),
    ),
    Mutant(
        "bonus_from_wrong_slot",
        "sampling",
        "Bonus token sampled from the wrong slot: p at the last draft's position instead of the one after it.",
        "After k accepted drafts the bonus is drawn from p(· | prefix) without the last accepted draft. "
        "Shows in every family-A sampling cell whose tested horizon reaches the first bonus (k < L).",
        _bonus_in_horizon,
        None,
        FIRST_SLOT_UNTOUCHED + " (the bonus is token k+1)",
        verifier=bugs.in_sampled_rounds(bugs.verify_bonus_from_wrong_slot),
    ),
    Mutant(
        "bonus_from_wrong_slot_on_25pct_of_rounds",
        "sampling",
        "Intermittent bonus from the wrong slot: on 25% of each row's rounds the bonus is drawn from p at "
        "the last draft's position.",
        "bonus_from_wrong_slot on a quarter of the rounds (independently): the bonus token's law is the "
        "mixture 0.75·p + 0.25·p_previous_slot. Shows where the tested horizon reaches a bonus (k < L).",
        _bonus_in_horizon,
        None,
        FIRST_SLOT_UNTOUCHED + " (the bonus is token k+1)",
        verifier=bugs.in_sampled_rounds(bugs.on_share_of_rounds(bugs.verify_bonus_from_wrong_slot, BONUS_SHARE)),
    ),
    Mutant(
        "recovered_after_rejected",
        "sampling",
        "Token emitted after the rejected slot: the replacement is drawn conditioned on the rejected draft.",
        "At the first rejection the emitted token is drawn from p after the rejected draft, i.e. "
        "conditioned on a token that was never emitted (greedy: argmax of the next slot).",
        _sampled(),
        laws.recovered_after_rejected,
        verifier=bugs.verify_recovered_after_rejected_any,
    ),
    Mutant(
        "shared_uniform",
        "sampling",
        "Correlated uniforms: one uniform per row reused across slots and for the recovered draw.",
        "One uniform u drives all acceptance tests and the recovered draw. A rejection means u >= "
        "min(1, p/q), so the inverse-CDF recovered draw sees only the top of the residual's CDF; the "
        "slots' acceptances are also correlated. (Reusing u for acceptance alone is a second-order "
        "effect, ~β², too small to plant as a realistic must-catch bug.)",
        _sampled(),
        laws.shared_uniform,
        verifier=bugs.in_sampled_rounds(bugs.verify_shared_uniform),
    ),
    Mutant(
        "recovery_reuses_draft_noise",
        "sampling",
        "Draft noise reused: the recovered token drawn with the exponential-race noise the draft was drawn with.",
        "After a rejection the residual is sampled by argmax r / E with the E the drafter drew its draft with; "
        "given the draft, that noise is largest where q is, so tokens the draft favoured are under-emitted. "
        "Only rejected rounds act, and the shift grows with q's mass off the draft: a narrow vocabulary and a "
        "drafter far from the target show it.",
        _sampled(),
        no_law="the recovered draw under the reused noise has no closed-form law",
        verifier=bugs.in_sampled_rounds(bugs.verify_recovery_reuses_draft_noise),
    ),
    Mutant(
        "stale_q",
        "sampling",
        "Stale q: each slot's q reported from the previous round while the draft comes from the current one.",
        "The verifier accepts with min(1, p/q_old) and recovers from norm(max(0, p - q_old)) a draft drawn "
        "from q_new: tokens the current round over-drafts are over-emitted. Acts from the second round on, "
        "at every family-A sampling cell; opposite-signed at different prefixes, so the pooled PIT law "
        "barely moves and the p - q ordered PIT carries the power.",
        _sampled(),
        no_law="the first round reports its own q: the first token is exact",
        wrap_drafter=planted.stale_q,
    ),
    Mutant(
        "stale_q_on_30pct_of_rounds",
        "sampling",
        "Intermittent stale q: on 30% of each row's rounds each slot's q is reported from the previous round.",
        "stale_q on a share of the rounds (independently), as a buffer refresh that loses a race now and "
        "then: on the rounds it hits the verifier judges the current drafts by last round's q; every other "
        "round is exact. Between no bug and the catalogue point of the stale-q class.",
        _sampled(),
        no_law="the first round reports its own q: the first token is exact",
        wrap_drafter=lambda drafter: planted.stale_q(drafter, STALE_SHARE),
    ),
    Mutant(
        "one_id_underreported",
        "sampling",
        f"Drafter misreports one token: id {planted.MISREPORTED_ID} drawn {planted.MISREPORT_FACTOR:g}x as "
        "often as its reported q says.",
        "Under-reporting q(x*) raises min(1, p/q) for x*, so x* is accepted more often than p allows and "
        "over-emitted at every prefix that drafts it; the other tokens shrink by a little each. One id's "
        "count against Σ p (pit.token_counts) sees it; the pooled PIT law spreads it thin. Main target only "
        "(the small target has no id 30).",
        _main_sampled,
        laws.one_id_underreported,
        wrap_drafter=planted.misreporting(planted.one_id_underreported, "one-id-under", "one_id_underreported"),
    ),
    Mutant(
        "one_id_underreported_2x",
        "sampling",
        f"Drafter misreports one token by less: id {planted.MISREPORTED_ID} drawn {SMALL_MISREPORT:g}x as often "
        "as its reported q says.",
        f"one_id_underreported at a smaller magnitude ({SMALL_MISREPORT:g}x instead of "
        f"{planted.MISREPORT_FACTOR:g}x): the same over-acceptance of one id, between no bug and the "
        "catalogue's point. Main target only.",
        _main_sampled,
        laws.one_id_underreported_by(SMALL_MISREPORT),
        wrap_drafter=planted.misreporting(
            planted.one_id_underreported_by(SMALL_MISREPORT), "one-id-under-2x", "one_id_underreported_2x"
        ),
    ),
    Mutant(
        "typical_acceptance",
        "sampling",
        "Lossy typical acceptance (Medusa-style): keep drafts with p(x) > min(ε, δ·e^-H), resample from p.",
        "Drafts with p(x) above min(0.09, 0.3·e^-H(p)) pass outright and rejections resample from p, "
        "so low-probability tokens are under-emitted — even for the self-draft oracle.",
        _sampled(FAMILY_A),
        laws.typical,
        verifier=bugs.in_sampled_rounds(bugs.verify_typical),
    ),
    Mutant(
        "penalties_ignored_while_speculating",
        "sampling",
        "Penalties ignored while speculating: the verifier's p skips the repetition / presence / frequency "
        "penalties the drafter's q was processed with (vLLM #18902, TRT-LLM #17701, SGLang #28180).",
        "Rejection sampling is exact for the p it is given, so the output follows the unpenalised target: "
        "ids already in the prompt or output are over-emitted. Shows in the penalty cells.",
        _history("penalties"),
        no_law=HISTORY_NO_LAW,
        history=history_bugs.penalties_ignored,
    ),
    Mutant(
        "one_penalty_state_per_round",
        "sampling",
        "One penalty state broadcast over a round: every position of [pending, d_1 .. d_k] is processed with "
        "the history before the round, position j not seeing drafts 1..j (SGLang PR #40244).",
        "A draft repeated within a round escapes the penalty at the later slot, and min tokens stays masked "
        "or unmasked for the whole round. Shows in the penalty and min-tokens cells from slot 1 on.",
        _history("penalties", "min_tokens"),
        no_law=HISTORY_NO_LAW,
        history=history_bugs.one_state_per_round,
    ),
    Mutant(
        "penalty_counted_once_per_round",
        "sampling",
        "Penalties record one token per round (the last committed) instead of every accepted token (SGLang PR #33643).",
        "Accepted drafts but the last escape the penalty's counts from then on, so ids the round emitted "
        "are under-penalised later. Shows in the penalty cells once rounds accept more than one token.",
        _history("penalties"),
        no_law=HISTORY_NO_LAW,
        history=history_bugs.PerRoundState(counts_tokens=True, counts_rounds=False),
    ),
    Mutant(
        "min_tokens_counted_in_rounds",
        "sampling",
        "Min tokens counted in rounds (steps) instead of tokens (SGLang PR #33643's min_new_tokens).",
        "A round emits up to k + 1 tokens, so EOS and the stop ids stay masked past min_tokens output "
        "tokens: they are under-emitted there. Shows in the min-tokens cell.",
        _history("min_tokens"),
        no_law=HISTORY_NO_LAW,
        history=history_bugs.PerRoundState(counts_tokens=False, counts_rounds=True),
    ),
    Mutant(
        "bias_and_bans_at_first_position_only",
        "sampling",
        "Logit bias, banned ids and the grammar mask applied at the round's first position only, the draft "
        "positions' logits left raw (SGLang #10617; vLLM PRs #44297, #48516 for the grammar).",
        "A banned or ungrammatical id can be recovered or a bonus after the first slot (a token of target "
        "probability 0), and a biased id keeps its unbiased probability there. Shows in the logit-bias, ban "
        "and grammar cells.",
        _history("logit_bias", "banned_ids", "grammar"),
        no_law=HISTORY_NO_LAW,
        history=history_bugs.first_position_only,
    ),
    Mutant(
        "min_p_at_first_position_only",
        "sampling",
        "Min-p applied at the round's first position only (SGLang #10617).",
        "After slot 0 the verifier's p keeps the tokens min-p cuts: recovered and bonus tokens there can "
        "have target probability 0. Shows in the min-p cell.",
        _history("min_p"),
        no_law=HISTORY_NO_LAW,
        verifier=bugs.verify_min_p_at_first_slot_only,
    ),
    Mutant(
        "history_left_out_of_q",
        "sampling",
        "The drafter samples from logits processed with the request's history (penalties, bias, bans, min "
        "tokens) but reports q processed without it (transformers #47932).",
        "The verifier judges each draft by a q other than the one it was drawn from: tokens the history "
        "steps boost are over-accepted, those they cut under-accepted. Shows in every history cell.",
        _history("penalties", "logit_bias", "banned_ids", "min_tokens", "grammar"),
        no_law=HISTORY_NO_LAW,
        wrap_drafter=planted.misreporting(
            planted.history_left_out_of_report, "history-out-of-q", "history_left_out_of_q"
        ),
    ),
    Mutant(
        "bonus_counted_not_written",
        "greedy",
        "Bonus token dropped: counted in the emitted length but never written (placeholder id leaks out).",
        "Whenever a row accepts all k drafts it emits the placeholder id 0 where the bonus belongs "
        "(both decoding modes). Shows in every family-A greedy cell, the oracle's included.",
        _greedy(FAMILY_A),
        None,
        GREEDY_NO_LAW,
        verifier=bugs.verify_bonus_counted_not_written,
    ),
    Mutant(
        "stale_target_cache",
        "greedy",
        "Target KV cache not rolled back after a rejection: the next round appends after the rejected drafts.",
        "Rejected drafts' keys/values stay in the target's context and positions drift. Shows where "
        "drafts are rejected: the family-A greedy cells (the oracle never rejects).",
        _greedy(),
        None,
        GREEDY_NO_LAW,
        wrap_target=targets.StaleCache,
    ),
    Mutant(
        "batch_max_positions",
        "greedy",
        "Position ids wrong after a ragged batched rollback: one batch-wide step counter (the max) for every row.",
        "Rows that accepted fewer drafts than the batch's best get positions ahead of their cache, "
        "shifting rotary phases. Shows where rows accept different counts: family-A greedy cells.",
        _greedy(),
        None,
        GREEDY_NO_LAW,
        wrap_target=targets.BatchMaxPositions,
    ),
    Mutant(
        "prefix_cache_stale_after_rollback",
        "greedy",
        "Stale prefix-cache entry after a rollback: a block is cached once written, the pending token's slot included.",
        "After a rejection the pending token's slot still holds the rejected draft's keys / values; a block "
        "stored with it serves them to every later request sharing the prefix. Shows in the warm prefix-cache "
        "cells, whose second turn reuses the blocks the first turn stored while decoding.",
        _serving(prefix="warm"),
        None,
        GREEDY_NO_LAW,
        prefix_cache=serving.stale_cache,
    ),
    Mutant(
        "prefix_hash_partial_block",
        "greedy",
        "Prefix-cache block hash that ignores part of the block (its last token).",
        "Prefixes that differ only in a block's last token share the entry, so a request reuses another "
        "prompt's keys / values. Shows in the warm prefix-cache cells (each second-turn request has a sibling "
        "differing in exactly that token).",
        _serving(prefix="warm"),
        None,
        GREEDY_NO_LAW,
        prefix_cache=serving.partial_hash_cache,
    ),
    Mutant(
        "retired_row_leak",
        "greedy",
        "Continuous batching: a retired row's state leaks into the next request admitted into it.",
        "The row's offset is not reset: the new prompt lands after old tokens of the row and the request "
        "attends to their cache entries, so its output is conditioned on another request. Shows in the "
        "continuous-batching cells.",
        _serving(batching="continuous"),
        None,
        GREEDY_NO_LAW,
        scheduler=serving.RetiredRowLeak,
    ),
    Mutant(
        "stop_leak_in_block",
        "sampling",
        "Stop checked on the last token of a round only: tokens after an EOS or stop id inside an accepted block leak.",
        "A round that accepts a stop id (or EOS) before its last emitted token commits the tokens after it, and the "
        "row runs on. Each leaked token is drawn from the target's law, so no token test sees it; the end check "
        "of every sampled cell does (nothing after an end token). Shows in the family-A cell with a stop id.",
        _with_stop_ids,
        None,
        "the bug changes where sequences end, not any token's law",
        ends=end_bugs.stop_checked_on_last_token,
    ),
    Mutant(
        "budget_checked_before_stop",
        "sampling",
        "max_new_tokens checked before the stop condition: a round that fills the budget ignores an end token in it.",
        "A row's last round, when it reaches the budget, commits up to the budget even past an EOS or stop id it "
        "accepted earlier in the block. Each leaked token is drawn from the target's law; the end check of every "
        "sampled cell sees it. Shows in the family-A cell with a stop id, where ends and budgets meet.",
        _with_stop_ids,
        None,
        "the bug changes where sequences end, not any token's law",
        ends=end_bugs.budget_checked_before_stop,
    ),
    Mutant(
        "stop_string_at_round_end",
        "sampling",
        "A stop string matched only where a round's text ends: one completed inside an accepted block is missed.",
        "The stop check reads whether the output ends with a stop string after each round, as transformers' "
        "StopStringCriteria does in assisted generation (its own comment: the block is cropped at EOS and the "
        "budget only). One token a round never misses a string; a block does, and the row runs on past it. "
        "Each leaked token is drawn from the target's law; the end check of the stop-string cell sees it.",
        _with_stop_strings,
        None,
        "the bug changes where sequences end, not any token's law",
        stop_rule=end_bugs.stop_string_at_round_end,
    ),
    Mutant(
        "stop_string_tokens_kept",
        "sampling",
        "A stop string completed inside an accepted block ends the row at the round's end: the tokens after it kept.",
        "The string is found in the round's new text, but the row keeps every token the round accepted, the ones "
        "after the string's last included (vLLM's detokenizer drops them: 'possible when multiple tokens are "
        "appended in one step'). Each leaked token is drawn from the target's law; the end check sees it.",
        _with_stop_strings,
        None,
        "the bug changes where sequences end, not any token's law",
        stop_rule=end_bugs.stop_string_tokens_kept,
    ),
    Mutant(
        "logprobs_zero",
        "sampling",
        "Every reported logprob 0.0 on the speculative path.",
        "The tokens are exact; the log-probabilities reported with them are not, and a training loop reading "
        "them sees certainty. The logprob check of every PIT cell compares each with the teacher-forced target's.",
        _main_sampled,
        None,
        LOGPROB_NO_LAW,
        logprobs=logprob_bugs.logprobs_zero,
    ),
    Mutant(
        "logprobs_of_draft",
        "sampling",
        "Accepted drafts reported with the drafter's log q(x) instead of the target's log p(x).",
        "The tokens are exact; an accepted draft's logprob is the drafter's. Shows wherever q and p differ at an "
        "accepted draft: every family-A PIT cell (the logprob check).",
        _main_sampled,
        None,
        LOGPROB_NO_LAW,
        logprobs=logprob_bugs.logprobs_of_draft,
    ),
    Mutant(
        "logprobs_of_next_position",
        "sampling",
        "Logprobs read from a buffer the next position overwrote: the token at slot j reported under slot j+1's law.",
        "The tokens are exact; their logprobs are another position's (logits not cloned before a later write). "
        "Shows in every PIT cell whose rounds emit more than one token (the logprob check).",
        _main_sampled,
        None,
        LOGPROB_NO_LAW,
        logprobs=logprob_bugs.logprobs_of_next_position,
    ),
    Mutant(
        "rows_mixed_up",
        "greedy",
        "Batch rows mixed up when they accept different counts (sorted for a ragged commit, never unsorted).",
        "A row commits another row's tokens whenever rows accept different counts (both decoding "
        "modes). Shows in the family-A greedy cells (the oracle's rows all accept k).",
        _greedy(),
        None,
        GREEDY_NO_LAW,
        verifier=bugs.verify_rows_mixed_up,
    ),
)
