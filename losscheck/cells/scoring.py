"""Scoring generated sequences under the target: one fresh teacher-forced pass per chunk of rows,
the randomized PIT of every generated token, and the PIT tests with the facts the certificate keeps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from losscheck.cells.logprob_check import LogprobCheck
from losscheck.cells.record import SampleFacts
from losscheck.core.contract import expect_rows, keep_rows
from losscheck.core.engine import pad_prompts
from losscheck.core.generation import Generation
from losscheck.core.history import History, adjust_logits
from losscheck.core.sampling import SamplingParams, make_generator, process_logits, top_p_band
from losscheck.core.target import HFTarget

if TYPE_CHECKING:
    from losscheck.run.context import CellContext
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.buglaws import BugClass
    from losscheck.stats.result import TestResult
    from losscheck.stats.streams import StreamValues


POOLED_TV_MISS = 0.05  # the pooled TV bound's miss rate per cell, split over its looks

# Bytes held per row x scored position x vocabulary entry while a chunk is scored: float32 logits of
# the whole row, the processed float32 distributions, the top-p cut-off's sorted logits, order,
# cumulative mass and two rank counts (int64), and randomized_pit's float64 copy, mask and masked sum.
BYTES_PER_LOGIT = 64


class ChunkObserver(Protocol):
    """What else reads each scored chunk's p (a black-box engine's drafter,
    `losscheck.cells.engine.rounds.RoundsScoring`)."""

    def observe(
        self,
        rows: list[list[int]],
        gen: Generation,
        at: slice,
        forced: ForcedProbs,
        power_rows: torch.Tensor | None = None,
    ) -> None: ...


def pit_chunk_rows(width: int, vocab: int, budget_bytes: int, max_rows: int) -> int:
    """Rows scored at once so that a chunk of `width` positions over `vocab` stays within the budget."""
    return max(1, min(max_rows, budget_bytes // (width * vocab * BYTES_PER_LOGIT)))


class ForcedProbs(NamedTuple):
    """One chunk's teacher-forced distributions and what its cut-off leaves uncertain.

    probs     [n, L, V]  the target's law of each generated token after the request's logits
                         processing; at an ambiguous position, conditioned on the tokens every
                         implementation keeps (`cutoff_uncertain`)
    ambiguous [n, L]     bool, positions where implementations may keep different sets of tokens
    left_out  [n, L]     bool, positions whose drawn token one implementation may keep and another cut
                         (every token of a position where no token is surely kept)
    wide      [n, L, V]  the law before the cut-off on every token some implementation may keep
                         (`widest_law`), `probs` where the cut-off is not ambiguous; None where none is
    no_sure   [n, L]     bool, positions where no token is surely kept (None where none is ambiguous)
    """

    probs: torch.Tensor
    ambiguous: torch.Tensor
    left_out: torch.Tensor
    wide: torch.Tensor | None = None
    no_sure: torch.Tensor | None = None


def teacher_forced_probs(
    target: HFTarget, rows: list[list[int]], tokens: torch.Tensor, params: SamplingParams, tolerance: float = 0.0
) -> ForcedProbs:
    """A fresh target pass over prompt + generated `tokens [n, L]`, independent of the engine's
    cache: the prompts (but their last tokens) are read into a new cache first, each distinct one
    once (a cell's rows cycle over a few prompts), then every row's last prompt token and generated
    tokens in one pass whose logits are the predictions of the generated tokens.

    Where another implementation of the same top-k / top-p cut-off, on logits within `tolerance`
    of these (the engine's cached pass has another batch shape), may keep another set of tokens,
    the law is conditioned on the set S every such implementation keeps: whichever set T ⊇ S the
    engine kept, its draw, given that it landed in S, follows p restricted to S. The PIT tests
    then read only the draws that landed in S — the event is the token's, and given it the PIT is
    uniform — and leave out the rest (`left_out`, about the mass of the uncertain tokens: 1e-3 at
    top-p 0.9 on 8,192 tokens). A token no implementation keeps still has p = 0: a support failure.
    """
    n, horizon = tokens.shape
    prompt_ids, plen = pad_prompts(rows, target.vocab_size, target.device)  # [n, P], [n]
    target.reset(n, prompt_ids.shape[1] + horizon)
    if prompt_ids.shape[1] > 1:  # slots 0 .. P-2; a shorter row's padding there is rewritten below
        expect_rows(target, plen - 1)  # a recurrent state: record only the states a row may keep
        target.forward(prompt_ids[:, :-1], torch.zeros(n, dtype=torch.long, device=prompt_ids.device))
        keep_rows(target, plen - 1)  # a recurrent state rolls back from the padding by checkpoint
    last = prompt_ids.gather(1, (plen - 1)[:, None])  # [n, 1]
    scored = torch.cat([last, tokens[:, :-1]], dim=1)  # [n, L] the inputs that predict tokens 0 .. L-1
    expect_rows(target, torch.full_like(plen, horizon))  # nothing reads on after this pass: no state recorded
    logits, _ = target.forward(scored, plen - 1)  # [n, L, V]
    # generated token i reads the prompt and tokens 0 .. i-1 (past a row's end: junk, never tested)
    logits = adjust_logits(logits, params, History(prompt_ids, plen, plen, target.eos_id), tokens[:, :-1])
    probs, uncertain = cutoff_law(logits, params, tolerance)  # [n, L, V] each
    left_out = uncertain.gather(-1, tokens[..., None].clamp(0, logits.shape[-1] - 1)).squeeze(-1)  # [n, L]
    ambiguous = uncertain.any(-1)  # [n, L]
    if not bool(ambiguous.any()):
        return ForcedProbs(probs, ambiguous, left_out)
    wide = widest_law(logits, params, probs, uncertain)
    return ForcedProbs(probs, ambiguous, left_out, wide, uncertain.all(-1))


def cutoff_law(logits: torch.Tensor, params: SamplingParams, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling law of `logits [n, L, V]` under `params`, conditioned on the tokens every
    implementation of its cut-off keeps → (p [n, L, V], uncertain [n, L, V] bool, `cutoff_uncertain`).
    Where no token is surely kept, p is `process_logits`' own and every token is uncertain."""
    if params.top_p < 1 and not params.greedy:  # one sort of the vocabulary serves both
        ranking = Ranking.of(logits, params)
        probs = ranking.top_p_law(params.top_p)
        probs = process_logits(logits, params) if probs is None else probs  # [n, L, V]
        uncertain = cutoff_uncertain(logits, params, tolerance, ranking)  # [n, L, V]
    else:
        probs = process_logits(logits, params)  # [n, L, V]
        uncertain = cutoff_uncertain(logits, params, tolerance)  # [n, L, V]
    sure = probs.masked_fill(uncertain, 0.0)  # [n, L, V]
    mass = sure.sum(-1, keepdim=True)  # [n, L, 1], 0 where no token is surely kept
    conditioned = torch.where(mass > 0, sure / mass.clamp(min=torch.finfo(mass.dtype).tiny), probs)
    return conditioned, uncertain | (mass == 0)


def widest_law(
    logits: torch.Tensor, params: SamplingParams, conditioned: torch.Tensor, uncertain: torch.Tensor
) -> torch.Tensor:
    """The law before the cut-off [n, L, V] (temperature and penalties, no top-k, top-p or min-p)
    on every token some implementation may keep — the sure ones S, where `conditioned` [n, L, V]
    (`cutoff_law`'s) gives mass, and the `uncertain` ones U [n, L, V] — at the ambiguous positions;
    `conditioned` elsewhere. Every implementation's law there is this law on its own kept set K,
    S ⊆ K ⊆ S ∪ U, renormalized: what the round filter's bounds read
    (`losscheck.stats.hidden_rounds.kept_bounds`)."""
    if params.greedy:  # a point mass: no cut-off changes it
        return conditioned
    free = process_logits(logits, dataclasses.replace(params, top_k=0, top_p=1.0, min_p=0.0))  # [n, L, V]
    wide = free.masked_fill(~((conditioned > 0) | uncertain), 0.0)
    wide = wide / wide.sum(-1, keepdim=True).clamp_min(torch.finfo(wide.dtype).tiny)
    return torch.where(uncertain.any(-1, keepdim=True), wide, conditioned)


def cutoff_ambiguous(logits: torch.Tensor, params: SamplingParams, tolerance: float) -> torch.Tensor:
    """Positions [n, L] bool where another implementation of the same top-k / top-p cut-off, on
    logits `[n, L, V]` within `tolerance` of these, may keep another set of tokens (`cutoff_uncertain`)."""
    return cutoff_uncertain(logits, params, tolerance).any(-1)


@dataclass(frozen=True)
class Ranking:
    """Logits [n, L, V] in descending order (a stable sort): `ranked_logits` and the ids `order`;
    the law before the top-p stage (`process_logits` at top_p 1) as `before`, and as `ranked` in
    that order. The top-p law and its uncertain tokens both read it (`cutoff_law`)."""

    ranked_logits: torch.Tensor
    order: torch.Tensor
    before: torch.Tensor
    ranked: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, params: SamplingParams) -> Ranking:
        logits = logits.float()
        ranked_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [n, L, V]
        before = process_logits(logits, dataclasses.replace(params, top_p=1.0))  # [n, L, V]
        return cls(ranked_logits, order, before, before.gather(-1, order))

    def top_p_law(self, top_p: float) -> torch.Tensor | None:
        """`process_logits`' top-p law [n, L, V] from this ranking, the same to the bit, or None
        where it could differ. `process_logits` sorts the probabilities: the logits' order gives
        the same sequence of values wherever the law falls with the logit (a float32 exp need
        not: then None), and another id at a rank only among tokens of equal probability, which
        matters where two of them, positive, straddle the cut (then None)."""
        ranked = self.ranked  # [n, L, V]
        if not bool((ranked[..., 1:] <= ranked[..., :-1]).all()):
            return None
        mass_before = ranked.cumsum(-1) - ranked  # the mass strictly above each rank, summed as process_logits does
        drop_sorted = mass_before >= top_p  # [n, L, V]
        cut = drop_sorted[..., 1:] & ~drop_sorted[..., :-1]  # [n, L, V - 1] the first rank dropped
        if bool((cut & (ranked[..., 1:] == ranked[..., :-1]) & (ranked[..., 1:] > 0)).any()):
            return None
        drop = torch.zeros_like(drop_sorted).scatter(-1, self.order, drop_sorted)
        probs = self.before.masked_fill(drop, 0.0)
        return probs / probs.sum(-1, keepdim=True)


def cutoff_uncertain(
    logits: torch.Tensor, params: SamplingParams, tolerance: float, ranking: Ranking | None = None
) -> torch.Tensor:
    """Tokens [n, L, V] bool that one implementation of the top-k / top-p cut-off of `params`, on
    logits within `tolerance` of `logits [n, L, V]`, may keep and another cut.

    top-k: a kept token within `tolerance` of the first token out, and a token out within it of the
    last kept (ties included). top-p: a token is surely kept when the mass before it, counted over
    every token whose logit may rank above it (its own logit - `tolerance` and up), lies at least
    `top_p_band` below `top_p`, surely cut when the mass of the tokens that rank above it in every
    implementation (its logit + `tolerance` and up) lies at least the band above. A position that
    is ambiguous for top-k and also cut by top-p is uncertain throughout: which tokens reach the
    top-p stage changes every token's mass. (llama.cpp and torch.topk keep different 8 of the 64
    tied logits that follow a lone BOS: no token is surely kept there.) `ranking`: the logits'
    sort and the law before top-p, where the caller has them (`Ranking`; read at top-p only)."""
    vocab = logits.shape[-1]
    logits = logits.float()
    # a repetition penalty r scales a seen token's logit, and its error, by up to max(r, 1/r)
    tolerance *= max(params.repetition_penalty, 1 / params.repetition_penalty)
    if params.top_p < 1:  # top-p reads every token's rank
        ranking = Ranking.of(logits, params) if ranking is None else ranking
        ranked_logits, order = ranking.ranked_logits, ranking.order  # [n, L, V] each
    else:  # top-k and min-p read the first k + 1 ranks: a partial sort (at a tied edge both are uncertain)
        ranked_logits, order = logits.topk(min(max(params.top_k, 0) + 1, vocab), dim=-1)  # [n, L, k + 1]
    uncertain = torch.zeros_like(logits, dtype=torch.bool)  # [n, L, V]
    if params.min_p and not params.greedy:  # kept iff logit - max >= T ln(min_p); both ends may move
        edge = ranked_logits[..., :1] + params.temperature * math.log(params.min_p)  # [n, L, 1]
        uncertain |= (logits - edge).abs() <= 2 * tolerance
        if params.top_k or params.top_p < 1:  # the set reaching top-k / top-p is uncertain: so is every mass
            uncertain |= uncertain.any(-1, keepdim=True)
    if 0 < params.top_k < vocab:
        last_kept, first_out = ranked_logits[..., params.top_k - 1 : params.top_k + 1].unbind(-1)  # [n, L] each
        kept = torch.zeros_like(uncertain).scatter_(-1, order[..., : params.top_k], True)  # [n, L, V]
        uncertain |= kept & (logits <= first_out[..., None] + tolerance)
        uncertain |= ~kept & (logits >= last_kept[..., None] - tolerance)
        if params.top_p < 1:  # the set reaching the top-p stage is uncertain: so is every mass
            uncertain |= uncertain.any(-1, keepdim=True)
    if params.top_p < 1:
        assert ranking is not None  # set above for every top-p
        band = top_p_band(tolerance, vocab)
        uncertain |= _top_p_unsure(ranking.ranked, ranked_logits, order, params.top_p, band, tolerance)
    return uncertain


def _top_p_unsure(
    ranked: torch.Tensor, ranked_logits: torch.Tensor, order: torch.Tensor, top_p: float, band: float, tolerance: float
) -> torch.Tensor:
    """The top-p rule of `cutoff_uncertain` → tokens [n, L, V] bool, from the probabilities
    `ranked` [n, L, V] in descending logit order (`ranked_logits`; `order` the ids): uncertain
    where the largest mass before a token (over every token whose logit is within `tolerance` of
    its own or higher) exceeds top_p - band and the smallest (over the tokens above it by more
    than `tolerance`) falls short of top_p + band.

    Both masses grow with the rank, so only a window of ranks can qualify: from the first whose
    logit is within `tolerance` of the last token before the mass passes top_p - band, to the
    last within `tolerance` of the token at which it reaches top_p + band (widened by as much
    again, for rounding). The binary searches over the vocabulary that count the tokens above a
    rank run in that window only, as wide as the widest position's, or over every rank where that
    is half the vocabulary or more (flat logits, a wide band).

    On the text target's logits at top-p 0.9 ([48, 16, 8,192], one thread, 2026-12-07, best of
    5): 0.57-0.64 s against 1.42-1.73 s over every rank at float32's tolerance; at bfloat16's
    (0.3) every token of every position is uncertain and every rank is read (1.27-1.58 s against
    1.41-1.42 s)."""
    vocab = ranked.shape[-1]
    cum = torch.nn.functional.pad(ranked.cumsum(-1), (1, 0))  # [n, L, V + 1] mass of the first c tokens
    rising = (-ranked_logits).contiguous()  # [n, L, V] ascending, for searchsorted
    below = (cum <= top_p - band).sum(-1, keepdim=True)  # [n, L, 1] J: c_i <= top_p - band for i < J
    under = (cum < top_p + band).sum(-1, keepdim=True)  # [n, L, 1] K: c_i < top_p + band for i < K
    # a few float32 round-offs of the largest logit besides: `rising ± tolerance` is rounded too
    slack = 2 * tolerance + 1e-4 + 4 * torch.finfo(torch.float32).eps * rising.abs().amax(-1, keepdim=True)
    low = rising.gather(-1, (below - 1).clamp(0, vocab - 1)) - slack  # [n, L, 1] -logit_(J - 1), widened
    high = rising.gather(-1, (under - 1).clamp(0, vocab - 1)) + slack  # -logit_(K - 1), widened
    first = torch.where(below > 0, torch.searchsorted(rising, low, right=False), 0)  # [n, L, 1]
    last = torch.where(under <= vocab, torch.searchsorted(rising, high, right=True), vocab)  # [n, L, 1]
    width = max(int((last - first).max()), 1) if ranked.numel() else 1
    if 2 * width > vocab:  # as wide as half the vocabulary (bf16's band on flat rows): every rank
        every = _unsure(ranked, rising, cum, top_p, band, tolerance)  # [n, L, V]
        return torch.zeros_like(every).scatter_(-1, order, every)
    window = first + torch.arange(width, device=ranked.device)  # [n, L, W]
    inside = window < last
    ranks = window.clamp(max=vocab - 1)
    unsure = inside & _unsure(ranked.gather(-1, ranks), rising, cum, top_p, band, tolerance, rising.gather(-1, ranks))
    # ranks past a position's window point at a column of their own, dropped: scatter_ keeps one
    # value of a repeated index, and a repeated in-window id could lose its flag
    ids = torch.where(inside, order.gather(-1, ranks), vocab)  # [n, L, W]
    flags = torch.zeros(*ranked.shape[:-1], vocab + 1, dtype=torch.bool, device=ranked.device)
    return flags.scatter_(-1, ids, unsure)[..., :vocab]


def _unsure(
    mass: torch.Tensor,
    rising: torch.Tensor,
    cum: torch.Tensor,
    top_p: float,
    band: float,
    tolerance: float,
    at: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ranks [n, L, W] whose probability is `mass` and negated logit `at` (None: `rising`,
    every rank) that `_top_p_unsure` calls uncertain, from every rank's negated logits `rising`
    [n, L, V] (ascending) and masses before `cum` [n, L, V + 1]."""
    at = rising if at is None else at
    may_rank_above = torch.searchsorted(rising, at + tolerance, right=True)  # [n, L, W] counts
    surely_above = torch.searchsorted(rising, at - tolerance, right=False)  # [n, L, W] counts
    most = cum.gather(-1, may_rank_above) - mass  # the largest mass before, itself excluded
    least = cum.gather(-1, surely_above)  # the smallest
    return (mass > 0) & (most > top_p - band) & (least < top_p + band)


def teacher_forced_pit(
    target: HFTarget,
    rows: list[list[int]],
    gen: Generation,
    v: torch.Tensor,
    budget_bytes: int,
    max_rows: int,
    tolerance: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
    observe: Callable[[slice, ForcedProbs], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Randomized PIT u [N, L] of every generated token under the target (`v [N, L]` the PIT's
    uniforms), with the `ambiguous` [N, L] and `left_out` [N, L] of `teacher_forced_probs`, scored
    a chunk of rows at a time: peak memory stays within `budget_bytes` however large rows ×
    vocabulary grow. Rows are independent, so chunking leaves every value unchanged.
    `progress(done, n)` before each chunk; `observe(rows, forced)` after it, for what else reads
    the chunk's p."""
    from losscheck.stats.pit import randomized_pit

    n, horizon = gen.tokens.shape
    chunk = pit_chunk_rows(max(len(r) for r in rows) + horizon, target.vocab_size, budget_bytes, max_rows)
    u, ambiguous, left_out = [], [], []
    for start in range(0, n, chunk):
        if progress is not None:
            progress(start, n)
        end = start + chunk
        forced = teacher_forced_probs(target, rows[start:end], gen.tokens[start:end], gen.params, tolerance)
        u.append(randomized_pit(forced.probs, gen.tokens[start:end], v[start:end]))
        ambiguous.append(forced.ambiguous)
        left_out.append(forced.left_out)
        if observe is not None:
            observe(slice(start, end), forced)
    return torch.cat(u), torch.cat(ambiguous), torch.cat(left_out)


@dataclass
class PitScores:
    """A tested sample scored part by part (a sequential cell's looks), tested as one.

    Each `add` scores one part's sequences with a fresh teacher-forced pass: the randomized PIT
    of every generated token, the exact-conditional values and, when `power` is given, the bug
    classes' power and rule-out sums from the part's own p and q. `tests` then runs the PIT and
    exact-conditional tests over every part. `stream` names the PITs' uniforms (the cell id);
    `misreported_id`: the id the bug-class score test judges the misreporting-drafter class at —
    chosen by a pilot, never by the sample tested (None: that class is left out of the test).
    `rounds`: a black-box engine's drafter, scoring the verifier's classes from the same p.
    `power_rows` [N] bool: the rows of the next `add` whose steps the power sums read, the
    rounds classes' and `power`'s (an estimate of the per-token moments, chosen before the sample
    is drawn; None: every row); the tests and the rule-out e-values read every row.
    """

    ctx: CellContext
    stream: str
    target: HFTarget
    tolerance: float
    power: PowerAccumulator | None = None
    misreported_id: int | None = None
    rounds: ChunkObserver | None = None
    power_rows: torch.Tensor | None = None
    u: list[torch.Tensor] = field(default_factory=list)  # [n_j, L] per part
    mask: list[torch.Tensor] = field(default_factory=list)  # [n_j, L] generated
    ambiguous: list[torch.Tensor] = field(default_factory=list)  # [n_j, L] cut-off ambiguous
    left_out: list[torch.Tensor] = field(default_factory=list)  # [n_j, L] drawn token's cut-off uncertain
    slots: list[torch.Tensor | None] = field(default_factory=list)  # [n_j, L] or None
    spare: list[torch.Tensor] = field(default_factory=list)  # [n_j, L] completes pairs that EOS cuts
    parts: list[Any] = field(default_factory=list)  # ConditionalValues per scored chunk
    top: list[torch.Tensor] = field(default_factory=list)  # [c, L] float64 the target's top probability
    at_top: list[torch.Tensor] = field(default_factory=list)  # [c, L] bool the drawn token is the top token
    logp: list[torch.Tensor] = field(default_factory=list)  # [c] float64 log probability of each output
    end_p: list[torch.Tensor] = field(default_factory=list)  # [c, L] float64 the target's end probability
    at_end: list[torch.Tensor] = field(default_factory=list)  # [c, L] bool the drawn token ends the row
    keys: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (prompt, output) per row
    temperature: float = 1.0  # the sample's, read by `add`: the stream tests' slack divides by it
    logprobs: LogprobCheck | None = None  # the reported log-probabilities, when the engine gives them

    def add(self, rows: list[list[int]], gen: Generation, part: str = "") -> None:
        """Score `gen` (sequences continuing `rows`); `part` names its uniforms within the stream."""
        from losscheck.stats.conditional import ConditionalValues

        ctx, target = self.ctx, self.target
        seed = ctx.seed

        def stream(name: str) -> torch.Generator:
            return make_generator(seed, self.stream, f"{name}/{part}" if part else name)

        # v is drawn on the CPU, so a seed gives the same PIT uniforms on every device.
        v, v_order = (
            torch.rand(gen.tokens.shape, generator=stream(name), dtype=torch.float64).to(target.device)
            for name in ("pit-v", "pit-order-v")
        )
        generated = gen.mask()
        self.temperature = gen.params.temperature
        ends = ((target.eos_id,) if target.eos_id is not None else ()) + gen.params.stop_ids  # what ends a row
        if gen.logprobs is not None and self.logprobs is None:
            self.logprobs = LogprobCheck(self.tolerance, self.temperature)

        def observe(at: slice, forced: ForcedProbs) -> None:
            q = None if gen.draft_q is None else gen.draft_q.law(target.vocab_size, at).to(forced.probs.device)
            slots = None if gen.slots is None else gen.slots[at]
            p = forced.probs.double()
            if self.logprobs is not None and gen.logprobs is not None:
                self.logprobs.observe(gen.logprobs[at], gen.tokens[at], generated[at] & ~forced.ambiguous, p)
                if gen.top_ids is not None and gen.top_logprobs is not None:
                    read = generated[at] & ~forced.ambiguous
                    self.logprobs.observe_top(gen.top_ids[at], gen.top_logprobs[at], read, p)
            self._streams(rows[at], gen.tokens[at].to(p.device), generated[at].to(p.device), p, forced.left_out, ends)
            # the exact-conditional values read the engine's whole kept set (its acceptance ratio
            # and residual): an ambiguous position is left out of them whatever was drawn there
            self.parts.append(
                ConditionalValues.from_chunk(
                    p,
                    q,
                    gen.tokens[at],
                    v_order[at],
                    generated[at] & ~forced.ambiguous,
                    slots=slots,
                    k=gen.stats.k,
                    misreported_id=self.misreported_id,
                )
            )
            some = None if self.power_rows is None else self.power_rows[at].to(p.device)
            # the power sums read the positions every test reads: the conditional and rounds tests
            # leave a cut-off's ambiguous positions out, the PIT tests only the draws there that one
            # implementation may cut, so a claim at these positions' count holds for both
            if self.power is not None:
                read = generated[at] & ~forced.ambiguous
                summed = None if some is None else read & some[:, None].to(read.device)
                self.power.update(p, q, gen.tokens[at], slots, gen.stats.k, read, moments=summed)
            if self.rounds is not None:
                self.rounds.observe(rows[at], gen, at, forced, some)

        u, ambiguous, left_out = teacher_forced_pit(
            target,
            rows,
            gen,
            v,
            ctx.memory_budget_bytes,
            ctx.profile.batch,
            self.tolerance,
            lambda done, n: ctx.progress.update(self.stream, "sequences scored", done, n),
            observe,
        )
        mask = gen.mask().cpu()
        self.u.append(u.cpu())
        self.mask.append(mask)
        self.ambiguous.append(ambiguous.cpu() & mask)
        self.left_out.append(left_out.cpu() & mask)
        self.slots.append(None if gen.slots is None else gen.slots.cpu())
        self.spare.append(torch.rand(gen.tokens.shape, generator=stream("pit-pairs"), dtype=torch.float64))

    def _streams(
        self,
        rows: list[list[int]],
        tokens: torch.Tensor,
        generated: torch.Tensor,
        p: torch.Tensor,
        left_out: torch.Tensor,
        ends: tuple[int, ...],
    ) -> None:
        """Keep what the stream tests read of one chunk (`losscheck.stats.streams`): tokens [c, L]
        scored under p [c, L, V], `generated` [c, L] bool, `left_out` [c, L] the cut-off's uncertain
        draws, `ends` the ids that end a row (EOS and the stop ids)."""
        from losscheck.stats.streams import output_logp, outputs, top_tokens

        ids = torch.tensor(ends, dtype=torch.long, device=p.device)
        self.end_p.append(p[..., ids].sum(-1).double().cpu())  # [c, L]: min tokens' mask is in p
        self.at_end.append(torch.isin(tokens, ids).cpu())
        top, at_top = top_tokens(p, tokens)
        logp = output_logp(p, tokens, generated, left_out.to(p.device))  # [c]
        self.top.append(top.cpu())
        self.at_top.append(at_top.cpu())
        self.logp.append(logp.cpu())
        self.keys += [(tuple(prompt), output) for prompt, output in zip(rows, outputs(tokens, generated))]

    def stream_values(self, u: torch.Tensor, tested: torch.Tensor) -> StreamValues:
        """The stream tests' values of every part so far, `u` [N, L] and `tested` [N, L] the PIT
        tests' (the rows in the order they were scored)."""
        from losscheck.stats.streams import StreamValues, precision_slack, repeat_law

        hit, law = repeat_law(self.keys, torch.cat(self.logp))
        temperature = self.temperature
        return StreamValues(
            top=torch.cat(self.top),
            at_top=torch.cat(self.at_top),
            tested=tested,
            repeats=hit,
            repeat_law=law,
            first_u=torch.where(tested[:, 0], u[:, 0], math.nan),
            slack=precision_slack(self.tolerance, temperature) if temperature > 0 else 1.0,
            end_p=torch.cat(self.end_p),
            at_end=torch.cat(self.at_end),
        )

    @property
    def tested_tokens(self) -> int:
        """Tokens the PIT tests count so far: generated, and drawn where every implementation's cut-off keeps them."""
        return sum(int((m & ~x).sum()) for m, x in zip(self.mask, self.left_out))

    @property
    def read_by_every_test(self) -> int:
        """Tokens every test reads so far (the PIT, conditional and rounds tests): generated, at a
        position whose cut-off every implementation draws alike; what the bug-class claims count."""
        return sum(int((m & ~a).sum()) for m, a in zip(self.mask, self.ambiguous))

    def tests(
        self, alpha: float, pooled_tv: float | None = None, looks: int = 1
    ) -> tuple[list[TestResult], SampleFacts]:
        """The PIT tests and the exact-conditional tests of every part under `alpha` (split over
        both families by their counts) and the facts the certificate keeps about them.
        `pooled_tv`: the pooled tests must detect this binned TV (None: they report what they
        detect). `looks`: the stopping points of a sequential cell; the fixed-sample tests are
        judged at their share / `looks` (`losscheck.stats.sequential`)."""
        from losscheck.stats import registry
        from losscheck.stats.conditional import ConditionalValues, conditional_tests
        from losscheck.stats.pit import pit_tests

        profile = self.ctx.profile
        u, mask, ambiguous, left_out, spare = (
            torch.cat(x) for x in (self.u, self.mask, self.ambiguous, self.left_out, self.spare)
        )
        known = [s for s in self.slots if s is not None]
        slots = torch.cat(known) if len(known) == len(self.slots) else None
        tested = mask & ~left_out
        missing = frozenset() if slots is not None else frozenset({registry.SLOTS})
        alpha_pit = registry.split(alpha, registry.PIT, registry.CONDITIONAL, missing=missing).share(registry.PIT)
        streams = self.stream_values(u, tested)
        results = pit_tests(
            u,
            tested,
            alpha_pit / looks,
            profile.power,
            pooled_tv,
            profile.pit_bins,
            slots=slots,
            spare=spare,
            streams=streams,
        )
        results += conditional_tests(ConditionalValues.merge(self.parts), alpha - alpha_pit, profile.power, looks)
        facts = SampleFacts() if self.logprobs is None else self.logprobs.facts()
        return results, dataclasses.replace(
            facts,
            # at a sequential cell's data-dependent stop: a union over the looks it may stop at
            pooled_tv_upper=pooled_tv_upper(u[tested], profile.pit_bins, 1 - POOLED_TV_MISS / looks),
            pooled_tv_confidence=1 - POOLED_TV_MISS / looks,
            cutoff_ambiguous=int(ambiguous.sum()),
            cutoff_left_out=int(left_out.sum()),
            cutoff_tolerance=self.tolerance,
            pit_histogram=tuple(torch.histc(u[tested].float(), 20, 0, 1).tolist()),
            pit_quantiles=tuple(_quantiles(u[tested])),
        )


def pooled_tv_upper(u: torch.Tensor, n_bins: int, confidence: float = 0.95) -> float:
    """Upper confidence bound on the binned TV between the law of the PIT values `u` [n] and
    uniform: the observed binned TV plus the deviation every one of the 2^B events of the bins
    stays within (Hoeffding and a union over them), the values taken as independent — as they are
    under H0; under a bug the tokens of a sequence may be dependent, and the bound is then optimistic.
    A sequential cell passes `confidence` 1 - 0.05 / looks: its bound then holds at whichever look
    it stops (a union over the looks)."""
    import math

    n = len(u)
    if n == 0:
        return 1.0
    counts = torch.histc(u.double(), n_bins, 0, 1)
    observed = float((counts / n - 1 / n_bins).abs().sum() / 2)
    return min(1.0, observed + math.sqrt(math.log(2**n_bins / (1 - confidence)) / (2 * n)))


def measure_power(
    ctx: CellContext,
    target: HFTarget,
    rows: list[list[int]],
    gen: Generation,
    tolerance: float,
    rounds: ChunkObserver | None = None,
    classes: tuple[BugClass, ...] | None = None,
) -> PowerAccumulator:
    """What each test would see per token under each bug class (`classes`, default the whole
    catalogue), from `gen`'s own p and q (one teacher-forced pass, no test run): a pilot sample's,
    to size the sample that is tested. `rounds`: a black-box engine's drafter, gathering the
    verifier's classes' power too."""
    from losscheck.stats.bugclass import PowerAccumulator

    power = PowerAccumulator() if classes is None else PowerAccumulator(classes=classes)
    generated = gen.mask()

    def observe(at: slice, forced: ForcedProbs) -> None:
        q = None if gen.draft_q is None else gen.draft_q.law(target.vocab_size, at).to(forced.probs.device)
        slots = None if gen.slots is None else gen.slots[at]
        read = generated[at] & ~forced.ambiguous  # what every test reads (`PitScores.read_by_every_test`)
        power.update(forced.probs.double(), q, gen.tokens[at], slots, gen.stats.k, read)
        if rounds is not None:
            rounds.observe(rows[at], gen, at, forced)

    v = torch.zeros(gen.tokens.shape, dtype=torch.float64, device=target.device)
    teacher_forced_pit(target, rows, gen, v, ctx.memory_budget_bytes, ctx.profile.batch, tolerance, observe=observe)
    return power


def _quantiles(u: torch.Tensor, n: int = 99) -> list[float]:
    """The empirical quantiles of `u` at probabilities 1/(n+1) .. n/(n+1): a QQ plot in the record.
    A token of probability 0 under the target has no PIT value (NaN; `pit.support` fails on it):
    the quantiles are those of the others."""
    import numpy as np

    values = u.double().numpy()
    values = values[np.isfinite(values)]
    return np.quantile(values, np.arange(1, n + 1) / (n + 1)).tolist() if values.size else []
