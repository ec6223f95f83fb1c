"""Synthetic verification problems whose output law is known exactly.

A *case* is one synthetic request. Its target and its drafter are slot-dependent Markov tables:
the raw target logits of slot `j` depend on the token before it (the previous draft, or the
case's start token at slot 0), so a verifier sees logits that change with the drafts, as a real
target's do. A case is replicated over many rows of one verifier call; each row draws its own
drafts from the drafter's table.

Ragged rows go through the fixed-`k` `Verifier` signature: a row with `real < k` real drafts is
padded with the token `PAD`, drafted with certainty (q a point mass on it) and given logit −inf
by the target from slot `real` on (probability 0, as a vocabulary mask gives). The standard
verifier rejects that pad with certainty, so the accepted count never exceeds `real`, and the
token at slot `real` comes from the residual `norm(max(0, p - δ_PAD)) = p`: exactly the bonus of a
block of `real` drafts.

Exact laws, for the standard algorithm (Leviathan et al. 2023), writing `p_j`, `q_j` for the
processed target and draft distributions of slot `j` given the token before it:

- first emitted token: `p_0`, whatever `q` is (the losslessness property itself);
- (accepted count `a`, emitted tokens `y_0..y_a`) with `y_j = x_j` for `j < a`:
  `P = Π_{j<a} min(p_j, q_j)(x_j) · r_a(y_a)`, where `r_a = max(0, p_a - q_a)` for `a < real`
  (rejection probability times residual) and `r_real = p_real` (the bonus, or the residual at a pad).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from losscheck.core.sampling import SamplingParams, process_logits

VOCAB = 8
PAD = VOCAB - 1  # the pad draft of ragged rows (any id would do; the last is easy to read)
GREEDY_AGREEMENT = 0.7  # greedy rows: share of drafts that are the target's argmax


@dataclass(frozen=True)
class Case:
    """One synthetic request: tables of one block, replicated over many rows of a call."""

    name: str
    params: SamplingParams  # the request's sampling parameters
    start: int  # the token before slot 0
    target_logits: torch.Tensor  # [k+1, V, V] raw logits of slot j given the previous token (PAD −inf from `real`)
    draft: (
        torch.Tensor
    )  # [k, V, V] float64 q_j(· | previous token): what drafts are drawn from (one-hot: deterministic)
    real: int  # real drafts; slots real..k-1 hold PAD

    @property
    def k(self) -> int:
        return self.draft.shape[0]

    @property
    def vocab(self) -> int:
        return self.draft.shape[-1]


@dataclass(frozen=True)
class Call:
    """Cases verified together: one verifier call per chunk of their rows, shuffled together.

    The `Verifier` signature takes one `SamplingParams` and one `q` (a tensor or None) per call,
    so a batch mixing greedy and sampled requests, temperatures or truncations is run as one call
    per parameter group; inside a call, rows of different cases (targets, drafters, ragged
    lengths, one-hot and stochastic q) are mixed. A *mixed* call (cases of different parameters)
    runs only for a verifier that takes one request per row (`losscheck.verifiers.tier`).
    """

    name: str
    point_mass: bool  # q is passed as None (every case's draft table is one-hot)
    cases: tuple[Case, ...]

    @property
    def k(self) -> int:
        return self.cases[0].k

    @property
    def params(self) -> SamplingParams | None:
        """The cases' common parameters; None for a mixed call."""
        found = {c.params for c in self.cases}
        return found.pop() if len(found) == 1 else None


def target_table(case: Case) -> torch.Tensor:
    """[k+1, V, V] float64 p_j(· | previous token), processed with the case's params (rows sum to 1)."""
    p = process_logits(case.target_logits, case.params).double()
    return p / p.sum(-1, keepdim=True)


def first_token_law(case: Case) -> torch.Tensor:
    """[V] float64 law of the first emitted token: p_0 given the start token."""
    return target_table(case)[0, case.start]


def n_outcomes(vocab: int, k: int) -> int:
    """Outcomes (a, y_0..y_a) for a = 0..k: Σ V^(a+1)."""
    return sum(vocab ** (a + 1) for a in range(k + 1))


def outcome_offsets(vocab: int, k: int) -> torch.Tensor:
    """[k+1] long: first code of the outcomes with a accepted drafts."""
    sizes = torch.tensor([vocab ** (a + 1) for a in range(k + 1)], dtype=torch.long)
    return torch.cumsum(sizes, 0) - sizes


def encode(accepted: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N] long code of each row's outcome: offset(a) + y_0..y_a read as base-V digits, y_0 first.

    accepted [N] long in [0, k], tokens [N, k+1] long in [0, V) wherever slot <= accepted.
    """
    k = tokens.shape[1] - 1
    slot = torch.arange(k + 1, device=tokens.device)  # [k+1]
    digits = (accepted[:, None] - slot[None, :]).clamp(min=0)  # [N, k+1] place value exponent a - i
    emitted = slot[None, :] <= accepted[:, None]  # [N, k+1]
    place = torch.where(emitted, vocab**digits, 0)  # [N, k+1]
    value = (tokens.where(emitted, 0) * place).sum(-1)  # [N]
    return outcome_offsets(vocab, k).to(tokens.device)[accepted] + value


def decode(code: int, vocab: int, k: int) -> tuple[int, list[int]]:
    """The (accepted count, emitted tokens) of outcome `code` (`encode`'s inverse)."""
    offsets = outcome_offsets(vocab, k).tolist()
    accepted = max(a for a in range(k + 1) if offsets[a] <= code)
    value, tokens = code - offsets[accepted], []
    for _ in range(accepted + 1):
        value, digit = divmod(value, vocab)
        tokens.append(digit)
    return accepted, tokens[::-1]


def joint_law(case: Case) -> torch.Tensor:
    """[n_outcomes(V, k)] float64 exact law of (accepted, emitted tokens), indexed as `encode`."""
    p = target_table(case)  # [k+1, V, V]
    q = case.draft.double()  # [k, V, V]
    vocab, k = case.vocab, case.k
    parts = []
    reach = p.new_ones(1, 1)  # [V^a / V, V] mass of reaching slot a with drafts x_<a; last dim x_{a-1}
    for a in range(k + 1):
        if a > case.real:
            parts.append(p.new_zeros(vocab ** (a + 1)))
            continue
        stop = p[a] if a == case.real else (p[a] - q[a]).clamp_min(0.0)  # [V prev, V]
        kept = p[a].minimum(q[a]) if a < k else None  # [V prev, V]
        if a == 0:
            parts.append(stop[case.start])
            reach = kept[case.start][None, :] if kept is not None else reach
            continue
        parts.append((reach[:, :, None] * stop[None]).reshape(-1))  # [V^(a+1)]
        if kept is not None:
            reach = (reach[:, :, None] * kept[None]).reshape(-1, vocab)  # [V^a, V]
    law = torch.cat(parts)
    if not math.isclose(float(law.sum()), 1.0, abs_tol=1e-9):
        raise AssertionError(f"case {case.name}: the joint law sums to {float(law.sum())}, not 1")
    return law


def best_tokens(case: Case) -> torch.Tensor:
    """[k+1, V] long: the target's argmax at slot j given the previous token (greedy decoding)."""
    return case.target_logits.argmax(-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()


def _case(
    name: str,
    params: SamplingParams,
    target: torch.Tensor,
    draft_logits: torch.Tensor | None,
    real: int,
    start: int,
    draft_mode: str,
) -> Case:
    """A case from raw target logits `target` [k+1, V, V] and draft logits [k, V, V].

    draft_mode: "sampled" (q = the draft logits processed with `params`), "argmax" (a point mass
    on their argmax), "self" (q = p: the drafter is the target) or "greedy-mix" (for greedy rows:
    the target's argmax with probability GREEDY_AGREEMENT, else a uniform token, so that rows
    accept every count).
    """
    k = target.shape[0] - 1
    target = target.clone()
    target[real:k, :, PAD] = -math.inf  # the pad drafts: probability 0 under the target
    if draft_mode == "self":
        draft = process_logits(target[:k], params).double()
    elif draft_mode == "greedy-mix":
        vocab = target.shape[-1]
        draft = GREEDY_AGREEMENT * _one_hot_argmax(target[:k]) + (1 - GREEDY_AGREEMENT) / vocab
    elif draft_mode == "argmax":
        assert draft_logits is not None
        draft = _one_hot_argmax(draft_logits)
    else:
        assert draft_logits is not None
        draft = process_logits(draft_logits, params).double()
    draft = draft / draft.sum(-1, keepdim=True)
    pad = torch.nn.functional.one_hot(torch.tensor(PAD), target.shape[-1]).double()
    draft[real:] = pad  # [k - real, V, V] every previous token drafts the pad
    return Case(name=name, params=params, start=start, target_logits=target.float(), draft=draft, real=real)


def standard_calls(seed: int, vocab: int = VOCAB) -> tuple[Call, ...]:
    """The tier's calls: five sampled parameter groups (temperature, top-k, top-p, min-p, block
    length 2 to 5), each as one call with q as tensors (stochastic, one-hot, q = p, ragged, all pad) and
    one with q None (point mass, full and ragged); a greedy group (full, ragged, all pad) called
    once with q and once with q None; then two mixed calls (k = 4, one with q and one with q
    None) whose rows are greedy and sampled requests of every group's parameters."""
    gen = torch.Generator().manual_seed(seed)

    def logits(slots: int, scale: float = 1.5) -> torch.Tensor:
        return torch.randn(slots, vocab, vocab, generator=gen) * scale

    def start() -> int:
        return int(torch.randint(0, vocab - 1, (1,), generator=gen))

    groups = (
        (SamplingParams(temperature=1.0), 4),
        (SamplingParams(temperature=0.6, top_k=3), 3),
        (SamplingParams(temperature=1.3, top_p=0.8), 5),
        (SamplingParams(temperature=0.9, top_k=5, top_p=0.9), 2),
        (SamplingParams(temperature=1.0, min_p=0.2), 3),
    )
    calls = []
    for params, k in groups:
        label = params.label()
        target = logits(k + 1)
        close = target[:k] + logits(k, 0.8)  # a drafter that mostly agrees with the target
        far = logits(k)  # one that does not
        stochastic = (
            _case("close", params, target, close, k, start(), "sampled"),
            _case("far-ragged", params, logits(k + 1), far, k // 2, start(), "sampled"),
            _case("argmax-as-probs", params, target, close, k, start(), "argmax"),
            _case("self", params, logits(k + 1), None, k, start(), "self"),
            _case("all-pad", params, logits(k + 1), far, 0, start(), "sampled"),
        )
        calls.append(Call(f"{label}-k{k}-q", False, stochastic))
        point = (
            _case("point", params, target, close, k, start(), "argmax"),
            _case("point-ragged", params, logits(k + 1), far, 1, start(), "argmax"),
        )
        calls.append(Call(f"{label}-k{k}-point", True, point))
    greedy = SamplingParams(temperature=0.0)
    for point_mass in (False, True):  # greedy verification must ignore q, given or not
        rows = (
            _case("full", greedy, logits(5), None, 4, start(), "greedy-mix"),
            _case("ragged", greedy, logits(5), None, 2, start(), "greedy-mix"),
            _case("all-pad", greedy, logits(5), None, 0, start(), "greedy-mix"),
        )
        calls.append(Call(f"greedy-k4-{'point' if point_mass else 'q'}", point_mass, rows))
    sampled = [params for params, _ in groups]
    mixed: list[Case] = [_case("greedy", greedy, logits(5), None, 4, start(), "greedy-mix")]
    for params, (name, real, mode) in zip(
        sampled,
        (("close", 4, "sampled"), ("ragged", 2, "sampled"), ("argmax-as-probs", 4, "argmax"), ("self", 4, "self")),
    ):
        target = logits(5)
        mixed.append(
            _case(f"{name}-{params.label()}", params, target, target[:4] + logits(4, 0.8), real, start(), mode)
        )
    calls.append(Call("mixed-k4-q", False, tuple(mixed)))
    point_rows = [_case("greedy", greedy, logits(5), None, 4, start(), "greedy-mix")]
    for params, real in zip(sampled[:2], (4, 1)):
        target = logits(5)
        point_rows.append(
            _case(f"point-{params.label()}", params, target, target[:4] + logits(4, 0.8), real, start(), "argmax")
        )
    calls.append(Call("mixed-k4-point", True, tuple(point_rows)))
    return tuple(calls)
