"""Running a black-box engine's cells: the engine with speculation on against itself with it off.

- greedy (`greedy.engine_greedy`): on == off token for token on every prompt of the prompt sets;
  a divergence is triaged by the target's float64 top-2 margin (`losscheck.core.divergence`) in the
  engine's precision;
- one-sample (`one_sample.one_sample`, the engine declares the `precision` losscheck loads its target in):
  the speculative samples scored by teacher-forced PIT (`losscheck.cells.scoring.PitScores`) and,
  with the engine's draft model, the verifier's bug classes; speculation-off rows only after a
  rejection, to attribute it (`losscheck.cells.engine.attribution`);
- two-sample (`two_sample.two_sample`, `precision = None`): speculative samples against the same engine's
  samples with drafting off, independent seeds (`losscheck.stats.two_sample`).

Sampled horizons are at least 2k + 2 (k the engine's block length), so every row reaches a
second round and a bonus slot; rows cycle over the prompts of every tier.

Each cell is a generator of rounds of requests (`losscheck.cells.engine.phases`): the run decides
the order in which the engine answers them, and no cell holds the reference target across a
round (an engine that keeps one instance alive at a time never has it loaded beside one).

The phases, a module each: `dispatch` (the mode's phases behind the served-parameters check),
`greedy`, `one_sample`, `attribution` (after a one-sample rejection), `two_sample` and `proxy` (its
design); `handle` is the cell's engine, requests and answers; `phases` runs the rounds; `rounds`,
`logprobs`, `draft_law` and `streams` are what the one-sample phase scores and checks.
"""

from losscheck.cells.engine.dispatch import engine_draws, run_engine_cell
from losscheck.cells.engine.handle import as_generation, min_horizon, request

__all__ = ["as_generation", "engine_draws", "min_horizon", "request", "run_engine_cell"]
