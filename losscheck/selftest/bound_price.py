"""`python -m losscheck.selftest.bound_price`: what the verifier classes' rule-out e-values pay for
reading an ambiguous cut-off through bounds (`losscheck.stats.hidden_rounds.round_bounds`), on the
bundled text pair at top-p 0.9.

Rows are drawn from the target's own top-p law (one a prompt, seeded), as a lossless engine whose
cut-off keeps what losscheck's keeps would draw them. The same rows are scored twice: knowing that
kept set (tolerance 0: the filter reads each member's exact law) and not knowing it (the fp32
logit tolerance a black-box cell allows: every ambiguous position bounded over the kept sets).
Under H0 each log rule-out e-value grows; the difference is the bounds' price. Also printed: the
share of positions that are ambiguous, the mass of their uncertain tokens, and each class's
growth as the pilot predicts it (KL(p‖P'), `RoundsPower.rule_out_rate`).
"""

from __future__ import annotations

import argparse
import math

import torch


def measure(seed: int, rows: int, horizon: int) -> dict[str, tuple[float, float, float]]:
    """Per class, its log rule-out e-value at ρ = 1 with the kept set known, bounded, and as the
    known-set sample's power sums predict it (KL(p‖P'), `RoundsPower.rule_out_rate`), over `rows`
    rows a bundled prompt of `horizon` tokens drawn at `seed`; prints what the cut-off leaves
    ambiguous."""
    from losscheck import bundled
    from losscheck.cells.scoring import teacher_forced_probs
    from losscheck.core.precision import LOGIT_TOLERANCE
    from losscheck.core.sampling import SamplingParams, process_logits
    from losscheck.core.target import HFTarget, load_causal_lm
    from losscheck.run.options import Options
    from losscheck.run.session import Session
    from losscheck.stats.hidden_rounds import CLASSES, RoundsSample

    fixtures = bundled.fixtures_dir()
    target_dir, drafter_dir = fixtures / "text_target", fixtures / "text_drafter_a"
    session = Session(Options(target=str(target_dir)))
    prompts = [p for tier in session.prompt_sets.values() for p in tier for _ in range(rows)]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    target = HFTarget(load_causal_lm(target_dir), "text_target", {})
    drafter = HFTarget(load_causal_lm(drafter_dir), "text_drafter_a", {})
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for prompt in prompts:  # plain decoding, no cache: a few hundred short rows
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(horizon):
                probs = process_logits(target.model(ids).logits[:, -1], params)  # [1, V]
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
        drawn.append(ids[0, len(prompt) :])
    tokens = torch.stack(drawn)  # [n, L]
    generated = torch.ones(tokens.shape, dtype=torch.bool)
    q = teacher_forced_probs(drafter, prompts, tokens, params).probs.double()
    raw = teacher_forced_probs(drafter, prompts, tokens, SamplingParams()).probs.double()
    samples = []
    for tolerance in (0.0, LOGIT_TOLERANCE["fp32"]):
        forced = teacher_forced_probs(target, prompts, tokens, params, tolerance)
        p = forced.probs.double()
        wide = None if forced.wide is None else forced.wide.double()
        sample = RoundsSample(4, "round")
        sample.update(p, q, tokens, generated, generated & ~forced.left_out, None, raw, wide, forced.no_sure)
        samples.append(sample)
    if wide is not None:
        uncertain = 1 - (wide * (p > 0)).sum(-1)  # [n, L] the uncertain tokens' mass
        ambiguous = forced.ambiguous
        print(
            f"{len(drawn)} rows of {horizon} tokens, seed {seed}: {float(ambiguous.double().mean()):.1%} of "
            f"positions ambiguous, their uncertain tokens' mass {float(uncertain[ambiguous].mean()):.2e} on "
            f"average (largest {float(uncertain[ambiguous].max()):.2e})"
        )
    known, bounded = (s.rule_out_log_e() for s in samples)
    power = samples[0].power
    return {
        c.name: (known[c.name], bounded[c.name], (power.rule_out_rate(c.name, 1.0) or 0.0) * power.tokens)
        for c in CLASSES
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=2, help="rows a prompt")
    parser.add_argument("--horizon", type=int, default=16)
    args = parser.parse_args(argv)
    growth = measure(args.seed, args.rows, args.horizon)
    print("| class | log e, kept set known | log e, bounded | price | predicted (KL) |")
    print("|---|---|---|---|---|")
    for name, (known, bounded, predicted) in growth.items():
        price = f"{(known - bounded) / abs(known):.1%}" if abs(known) not in (0.0, math.inf) else "-"
        print(f"| {name} | {known:.2f} | {bounded:.2f} | {price} | {predicted:.2f} |")


if __name__ == "__main__":
    main()
