"""Shards (`losscheck.plan.shard`): the option's value and the assignment of a plan's cells to N
shards by estimated cost — deterministic, every cell exactly once, balanced within the costliest
cell's cost."""

from __future__ import annotations

import random

import pytest

from losscheck import cli
from losscheck.core.precision import Precision
from losscheck.errors import OptionError
from losscheck.plan import matrix
from losscheck.plan.cell import Cell
from losscheck.plan.shard import Shard, assign, parse_shard, share
from losscheck.run.options import pytest_args


def loads(shares: tuple[tuple[str, ...], ...], costs: dict[str, float]) -> list[float]:
    return [sum(costs[c] for c in cells) for cells in shares]


def random_costs(seed: int, cells: int) -> dict[str, float]:
    rng = random.Random(seed)
    return {f"c{i:03d}": round(rng.lognormvariate(1.0, 1.0), 1) for i in range(cells)}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_every_cell_lands_in_exactly_one_shard_balanced_within_the_costliest_cell(seed, count):
    costs = random_costs(seed, 40)
    shares = assign(list(costs.items()), count)
    assert len(shares) == count
    assert sorted(c for cells in shares for c in cells) == sorted(costs)
    spread = max(loads(shares, costs)) - min(loads(shares, costs))
    assert spread <= max(costs.values()) + 1e-9, f"loads {loads(shares, costs)} spread beyond the costliest cell"


def test_the_assignment_is_deterministic_whatever_the_order_given():
    costs = list(random_costs(0, 30).items())
    shuffled = costs[:]
    random.Random(1).shuffle(shuffled)
    assert assign(costs, 4) == assign(shuffled, 4) == assign(costs[::-1], 4)


def test_costliest_first_ties_by_cell_id_each_to_the_least_loaded_lowest_shard():
    costs = [("d", 1.0), ("b", 1.0), ("big", 5.0), ("a", 1.0), ("c", 1.0)]
    # big -> 1; then a, b, c, d (ties by id) -> 2, which stays the least loaded (4 < 5)
    assert assign(costs, 2) == (("big",), ("a", "b", "c", "d"))
    # equal loads go to the lowest index
    assert assign([("b", 1.0), ("a", 1.0)], 2) == (("a",), ("b",))


def test_more_shards_than_cells_leaves_the_last_shards_empty():
    assert assign([("a", 2.0), ("b", 1.0)], 4) == (("a",), ("b",), (), ())
    assert assign([], 2) == ((), ())


def test_a_shard_of_a_plan_is_its_share_of_the_entries_by_estimated_cost():
    cells = {
        matrix.GREEDY_CELL: [Cell("A", k, matrix.GREEDY) for k in (1, 2, 4, 8)],
        matrix.PIT_CELL: [Cell("A", 4, matrix.SAMPLING_VARIANTS[0], precision=Precision("bf16", "bf16"))],
        matrix.EXACT_CELL: [],
        matrix.ENGINE_CELL: [],
        matrix.ENGINE_GREEDY_CELL: [],
    }
    entries = matrix.entries(cells)
    first, second = (share(entries, Shard(i, 2)) for i in (1, 2))
    assert first == ("A-k4-T1-bf16",)  # the costliest cell alone outweighs the four greedy ones
    assert set(second) == {e.cell for e in entries} - set(first)


def test_the_option_parses_i_of_n_and_passes_on_as_typed():
    assert parse_shard("2/4") == Shard(2, 4) and parse_shard(" 1/1 ") == Shard(1, 1)
    assert pytest_args({"shard": Shard(2, 4)}) == ["--losscheck-shard=2/4"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0/2", "--losscheck-shard=0/2: no such shard"),
        ("3/2", "--losscheck-shard=3/2: no such shard"),
        ("1/0", "--losscheck-shard=1/0: no such shard"),
        ("x", "--losscheck-shard='x': expected I/N"),
        ("2", "--losscheck-shard='2': expected I/N"),
        ("-1/2", "--losscheck-shard='-1/2': expected I/N"),
    ],
)
def test_a_bad_shard_is_one_clear_error_with_the_accepted_form(text, says):
    with pytest.raises(OptionError, match=r"I/N, shard I of N with 1 <= I <= N") as raised:
        parse_shard(text)
    assert str(raised.value).startswith(says)


def test_the_cli_refuses_a_bad_shard_as_a_usage_error(capsys):
    assert cli.main(["certify", "--shard", "3/2"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --shard: --shard=3/2: no such shard; expected I/N" in err


def test_the_plan_fingerprint_names_an_engines_draft_model_by_hash_not_by_where_it_lies():
    """Two runners keep the draft model at different paths: one plan; another draft model: another."""
    import dataclasses

    from losscheck.report.certificate import run_meta
    from losscheck.report.shard import fingerprint
    from losscheck.run.options import Options
    from tests.support import manifest_record

    def engine(path: str, sha: str) -> dict:
        config = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
        return {"name": "vllm", "draft_model": {"path": path, "sha256": sha}, "options": {"speculative_config": config}}

    meta = run_meta(Options(), [])
    base = manifest_record([{"cell": "engine-k4-greedy", "mode": "engine-greedy", "argument": "engine_cell"}])
    here, there = (dataclasses.replace(base, engine=engine(p, "d" * 64)) for p in ("/a/draft", "/b/draft"))
    other = dataclasses.replace(base, engine=engine("/a/draft", "e" * 64))
    assert fingerprint(meta, here) == fingerprint(meta, there) != fingerprint(meta, other)
