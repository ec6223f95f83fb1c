"""Time `verify_rejection` against the form it replaced (float64 over the whole [B, k+1, V] block,
the residual at every slot) at three vocabularies, and check that both draw the same tokens.

    python reports/bench/verify_widening.py > reports/bench/verify_widening.txt

One call each, 32 rows, k = 4, float32 p and q, best of 5 repeats.
"""

from __future__ import annotations

import time

import torch

from losscheck.core.sampling import sample
from losscheck.core.verify import acceptance_probability, normalized, recovery_distribution, verify_rejection


def widening_everything(p, drafts, q, generator):
    """The rejection sampler before the stop-slot gather (losscheck up to commit 8fb8f09)."""
    batch, k = drafts.shape
    p, q = p.double(), normalized(q)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64)
    accepted = (u < acceptance_probability(p_draft, q_draft)).long().cumprod(-1).sum(-1)
    rows = torch.arange(batch)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    tokens[rows, accepted] = sample(recovery_distribution(p, q)[rows, accepted], generator)
    return accepted, tokens


def best_ms(run, repeats: int = 5) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3, out


def compare(vocab: int, rows: int, k: int) -> str:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(rows, k + 1, vocab, generator=g), -1)
    q = torch.softmax(2 * torch.randn(rows, k, vocab, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(rows, k)
    before, (accepted, tokens) = best_ms(lambda: widening_everything(p, drafts, q, torch.Generator().manual_seed(1)))
    after, out = best_ms(lambda: verify_rejection(p, drafts, q, torch.Generator().manual_seed(1)))
    same = torch.equal(out.accepted, accepted) and torch.equal(out.tokens, tokens)
    return f"V {vocab:>7,}: before {before:8.2f} ms, after {after:8.2f} ms, {before / after:4.1f}x; same draws: {same}"


def main() -> None:
    rows, k = 32, 4
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rows} rows, k = {k}")
    for vocab in (64, 32_000, 128_256):
        print(compare(vocab, rows, k))


if __name__ == "__main__":
    main()
