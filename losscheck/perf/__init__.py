"""The performance tier (`pytest -m perf`, `losscheck perf`): a drafter's speedup against the
baseline on a concurrency ladder, where it comes from, and whether it regressed.

One concept per module:

- `profiles`: the named sizes of a run (ladder, requests, output lengths, repeats);
- `workload`: the requests of a rung (prompts from the entropy tiers, output budgets);
- `serving`: requests in flight, admitted into finished rows between rounds (continuous batching);
- `metrics`: per-run figures (throughput, TTFT, TPOT, ITL, latency percentiles) and the speedup CI;
- `model`: the speedup's analytic decomposition into acceptance length and round cost;
- `peer`: Hugging Face assisted generation timed on the same requests;
- `suite`: the measurements of one run, memoised, shared by the tests and the report.

The run file and its regression compare (`losscheck.report.perf_run`) and the report's Markdown
and plots (`losscheck.report.perf`) live with the other renderers in `losscheck.report`.
"""
