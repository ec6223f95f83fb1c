"""Drawing a cell's sample: `n` sequences cycling over the prompts, in calls that fit the memory
budget, through the cell's server (`losscheck.serving.axis`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from losscheck.core.generation import Generation
from losscheck.serving.axis import Call, Server

if TYPE_CHECKING:
    from losscheck.run.context import CellContext


# Bytes held per row x scored slot x vocabulary entry by one engine round: the target's float32
# logits, the drafter's q, the processed p (top-p sorts: values and int64 indices), and the
# verifier's float64 p, q and residual.
ENGINE_BYTES_PER_LOGIT = 56


def engine_batch_rows(k: int, vocab: int, budget_bytes: int, max_rows: int) -> int:
    """Rows one engine call runs so that a round's [rows, k+1, V] tensors stay within the budget."""
    return max(1, min(max_rows, budget_bytes // ((k + 1) * vocab * ENGINE_BYTES_PER_LOGIT)))


def generate_rows(
    ctx: CellContext,
    server: Server,
    prompts: list[list[int]],
    n: int,
    horizon: int,
    stream: str,
    first: int = 0,
) -> tuple[list[list[int]], Generation]:
    """Draw `n` sequences of `horizon` tokens, cycling over `prompts`, in calls of at most the rows
    an engine batch holds within the memory budget (or what the server takes at once). `first`:
    the stream's index of the first sequence — draws at successive `first` continue one sample
    (a sequential cell's looks), each call seeded by where it starts."""
    cell = ctx.cell
    rows_fit = engine_batch_rows(cell.k, ctx.target.vocab_size, ctx.memory_budget_bytes, ctx.profile.batch)
    batch = min(server.call_rows(rows_fit), n)
    rows = [prompts[(first + i) % len(prompts)] for i in range(n)]
    calls = [
        Call(rows[start : start + batch], horizon, cell.params, (cell.id, stream, first + start))
        for start in range(0, n, batch)
    ]
    ctx.progress.update(cell.id, f"{stream} sequences drawn", 0, n)
    return rows, Generation.concat(server.generate(calls))
