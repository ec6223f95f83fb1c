"""Time `verify_rejection` against the form it replaced (float64 over the whole [B, k+1, V] block,
the residual at every slot) at three vocabularies, and check that both draw the same tokens.

    python reports/bench/verify_widening.py > reports/bench/verify_widening.txt

One call each, 32 rows, k = 4, float32 p and q, best of 5 repeats.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from losscheck.core.verify import BlockOutcome, verify_rejection
from losscheck.selftest.verifiers import widening_everything


def best_ms(run: Callable[[], BlockOutcome], repeats: int = 5) -> tuple[float, BlockOutcome]:
    times: list[float] = []
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
    before, ref = best_ms(lambda: widening_everything(p, drafts, q, torch.Generator().manual_seed(1)))
    after, out = best_ms(lambda: verify_rejection(p, drafts, q, torch.Generator().manual_seed(1)))
    same = torch.equal(out.accepted, ref.accepted) and torch.equal(out.tokens, ref.tokens)
    return f"V {vocab:>7,}: before {before:8.2f} ms, after {after:8.2f} ms, {before / after:4.1f}x; same draws: {same}"


def main() -> None:
    rows, k = 32, 4
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rows} rows, k = {k}")
    for vocab in (64, 32_000, 128_256):
        print(compare(vocab, rows, k))


if __name__ == "__main__":
    main()
