"""What a certificate claims from its cells' records (`losscheck.report.claims`)."""

from __future__ import annotations

from losscheck.report import claims
from losscheck.report.document import CurvePoint, RuledOut
from tests.support import cell_record, result_json, verdict_json


def records(*cells: dict) -> list:
    return [cell_record(**cell) for cell in cells]


def certificate_of(found: list):
    """The certificate (default options, no manifest) of the records `found`: its claims are theirs."""
    from losscheck.report import certificate
    from losscheck.run.options import Options

    return certificate.build(certificate.run_meta(Options(), []), [], found, 0, False)


def _pit(cell: str, tested: int, fixed: int, early: bool, power: float, ruled_out: bool) -> dict:
    return {
        "cell": cell,
        "sequences": tested // 16,
        "pilot_tokens": 2000,
        "fixed_design_tokens": fixed,
        "looks": {
            "tokens": [2000, 4000, 8000],
            "allowed": 5,
            "stopped_at": 1 if early else 3,
            "tested_tokens": tested,
            "early": early,
        },
        "verdict": verdict_json(cell, result_json("pit.support", tested)),
        "bug_classes": {
            "stale_q": {
                "test": "pit.bug_classes",
                "tokens_needed": 1000.0,
                "power": power,
                "covered": True,
                "ruled_out": ruled_out,
            }
        },
    }


def test_the_sequential_cells_report_their_tokens_against_the_fixed_design():
    found = records(_pit("A-k4-T1", 2032, 10800, True, 0.995, True), _pit("A-k8-T1", 8100, 9000, False, 0.997, False))
    t = claims.tested(found)
    assert (t.sequential_cells, t.stopped_early) == (2, 1)
    assert (t.sequential_tokens, t.fixed_design_tokens) == (10132, 19800)
    assert t.tokens == 10132 and t.pilot_tokens == 4000
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "1 of 2 stopped early" in text and "10,132 tokens" in text and "19,800 (51%)" in text


def test_a_class_counts_as_caught_only_at_the_stated_power():
    found = records(_pit("A-k4-T1", 2032, 10800, True, 0.995, True), _pit("A-k8-T1", 8100, 9000, False, 0.98, False))
    coverage = claims.coverage(found, 0.99)["stale_q"]
    assert coverage.caught_by == ("A-k4-T1",)
    assert coverage.best is not None and coverage.best.cell == "A-k4-T1"


def test_a_class_a_cell_withdrew_is_not_caught_there_and_is_named_not_covered():
    short = _pit("A-k8-T1", 8100, 9000, False, 0.995, False)
    short["bug_classes"]["stale_q"].update(covered=False, withdrawn="cell A-k8-T1: the tested sample fell short")
    found = records(_pit("A-k4-T1", 2032, 10800, True, 0.995, True), short)
    coverage = claims.coverage(found, 0.99)["stale_q"]
    assert coverage.caught_by == ("A-k4-T1",) and coverage.withdrawn_in == ("A-k8-T1",)
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "NOT COVERED in A-k8-T1" in text


def test_an_exact_cell_counts_its_sequences_times_its_horizon():
    verdict = verdict_json("A-k1-T1-small", result_json("exact.support", 100))
    exact = cell_record("A-k1-T1-small", kind="exact", horizon=4, sequences=100, verdict=verdict)
    assert claims.tested([exact]).tokens == 400


def test_a_run_without_sequential_cells_says_nothing_of_them():
    t = claims.tested([cell_record("x", verdict={"cell": "x", "alpha": 0.01, "passed": True, "results": []})])
    assert t.sequential_cells == 0
    assert not any("sequential" in line for line in claims.lines(certificate_of([])))


def _family(record: dict, down_to: float, curve: dict) -> dict:
    record["bug_classes"]["stale_q"].update(
        family={
            "required_down_to": down_to,
            "ruled_out_down_to": down_to,
            "members": [
                {"rho": 1.0, "beta": 0.005, "ruled_out": True},
                {"rho": down_to, "beta": 0.1, "ruled_out": True},
            ],
        },
        curve=curve,
    )
    return record


def test_the_claims_print_each_class_curve_and_how_far_early_stops_ruled_it_out():
    cells = [
        _family(_pit("A-k4-T1", 2032, 10800, True, 0.995, True), 0.3, {"0.99": 0.6, "0.8": 0.45}),
        _family(_pit("A-k8-T1", 8100, 9000, True, 0.997, True), 0.2, {"0.99": 0.5, "0.8": None}),
        _family(_pit("A-k2-T1", 9000, 9000, False, 0.997, False), 0.1, {"0.99": 0.4, "0.8": 0.3}),
    ]
    cells[0]["pooled_tv_upper"], cells[0]["pooled_tv_confidence"] = 0.05, 1 - 0.05 / 7
    found = records(*cells)
    coverage = claims.coverage(found, 0.99)["stale_q"]
    assert coverage.curve == {"0.99": CurvePoint(0.4, "A-k2-T1"), "0.8": CurvePoint(0.3, "A-k2-T1")}
    # the cell that ran to its last look ruled nothing out; the weaker of the two early stops is reported
    assert coverage.ruled_out == RuledOut(early_stops=2, down_to=0.3, beta=0.1)
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "ρ = 0.4 at power 0.99 (A-k2-T1)" in text
    assert "2 early stops ruled out its mixtures from ρ = 1 down to ρ ≤ 0.3 (each at β ≤ 0.1)" in text
    assert "the largest is 0.05 (A-k4-T1" in text and "not simultaneous over cells" in text


def test_greedy_cells_count_their_rollbacks_and_name_the_cells_without_one():
    found = records(
        {"cell": "user-k4-greedy", "kind": "greedy", "rollbacks": 120, "recurrent_state": True},
        {"cell": "user-k1-greedy", "kind": "greedy", "rollbacks": 0, "recurrent_state": True},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "120 rejected drafts" in text and "recurrent state included" in text and "in 1 of 2 cells" in text
    assert "no rollback exercised, so their PASS says nothing of rollback: user-k1-greedy" in text


def test_zero_draft_rounds_and_prefix_hits_are_counted_and_an_idle_path_is_named():
    prefix = {"hits": 0, "state_resumed": 0, "summary": "s"}
    found = records(
        {"cell": "user-k4-greedy-gaps3", "kind": "greedy", "rollbacks": 9, "zero_draft_rounds": 40},
        {
            "cell": "user-k4-greedy-prefix-warm",
            "kind": "greedy",
            "rollbacks": 9,
            "zero_draft_rounds": 0,
            "serving_facts": {"prefix": {**prefix, "hits": 12, "state_resumed": 5}},
        },
        {"cell": "user-k4-greedy-prefix-cold", "kind": "greedy", "rollbacks": 9, "serving_facts": {"prefix": prefix}},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "40 row-rounds in 1 of 3 greedy cells" in text
    assert "12 blocks reused in 1 of 2 greedy prefix-cache cells, 5 of them resuming a recurrent state" in text
    assert "no hit, so their PASS says nothing of a resumed prefix: user-k4-greedy-prefix-cold" in text
    without = "\n".join(claims.lines(certificate_of(records({"cell": "x", "kind": "greedy", "rollbacks": 1}))))
    assert "none ran, so the PASS says nothing of that path" in without


def test_the_draft_law_checks_are_counted_and_an_inconsistent_one_is_named():
    law = {"predicted_rounds": 100.0, "predicted_first_accepted": 80.0, "sd_first_accepted": 3.0}
    found = records(
        {"cell": "engine-k4-T1", "draft_law": {**law, "counted_first_accepted": 81, "verdict": "consistent"}},
        {"cell": "engine-k4-T0.3", "draft_law": {**law, "counted_first_accepted": 50, "verdict": "inconsistent"}},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "consistent in 1 (engine-k4-T1); inconsistent in 1 (engine-k4-T0.3)" in text
    assert "the drafter-side classes are withdrawn there" in text


def test_the_engine_cells_tokens_against_wald_s_bound_are_summed_with_the_costliest_named():
    def bound(cls: str, tested: int, wald: float, wald_h0: float) -> dict:
        return {
            "binding_class": cls,
            "test": "pit.bug_classes",
            "tested_tokens": tested,
            "wald_tokens": wald,
            "wald_h0_tokens": wald_h0,
            "ratio": tested / wald,
            "ratio_h0": tested / wald_h0,
        }

    promise = {"family_key": "residual_is_p@0.5", "family_tokens": 800.0, "ratio_family": 2.5}
    looks = {"tokens": [500, 1000, 2000], "allowed": 5, "stopped_at": 3, "tested_tokens": 2000, "early": False}
    found = records(
        {"cell": "engine-k4-T1", "bound": bound("target_temperature_1.1", 9000, 1350.0, 1160.0), "looks": looks},
        {
            "cell": "engine-k4-T0.3",
            "bound": {**bound("residual_is_p", 2000, 1000.0, 800.0), "at_floor": True, **promise},
            "looks": {**looks, "stopped_at": 2, "early": True},
        },
        {"cell": "engine-k4-greedy"},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "tokens read against the information bound in 2 one-sample engine cells (1 stopped before" in text
    assert "against the early stop's promise" in text and "2.5-2.5 times (median 2.5) in 1 cell" in text
    assert "sequential PIT cells" not in text  # engine cells' looks have no fixed-sample design to set against
    assert "2.5-7.8 times the bound under H0 (median 5.1) and 2.0-6.7 times it under the class (median 4.3)" in text
    assert (
        "the most, engine-k4-T1 (`target_temperature_1.1`, 9000 tokens against 1160); 1 cell sized by the floor" in text
    )


def test_a_second_stage_that_puts_a_rejection_down_to_the_reference_says_what_its_pass_covers():
    attribution = {"finding": "reference", "first_stage_failed": ["pit.surprisal (p = 1e-9)"], "rows": 576}
    found = records(
        {"cell": "engine-k4-T1", "attribution": {**attribution, "scores": ["surprisal", "pit_mean"]}},
        {"cell": "engine-k4-T0.3", "attribution": {**attribution, "finding": "speculation", "scores": ["surprisal"]}},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "engine-k4-T1: the reference differs from the engine, judged two-sample (a PASS of the row scores " in text
    assert "surprisal, pit_mean alone; its bug-class claims are that stage's own power)" in text
    assert "engine-k4-T0.3: speculation blamed. At reduced precision" in text and "kernel numerics" in text


def test_the_engine_claims_say_they_are_both_stages_and_where_the_second_is_planned():
    stage = {"scores": ["surprisal", "support"], "score_alpha": 2e-4}
    found = records(
        {"cell": "engine-k4-T1", "second_stage": {**stage, "rows": 1536}},
        {"cell": "engine-k4-T0.3", "second_stage": {**stage, "rows": 9600}},
        {"cell": "engine-k4-greedy"},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "the bug-class claims of 2 one-sample engine cells are each cell's chance to FAIL, both stages" in text
    assert "at 1,536-9,600 rows a side and drawn only after a first-stage rejection" in text
    assert "both stages" not in "\n".join(claims.lines(certificate_of(records({"cell": "engine-k4-greedy"}))))


def test_a_reduced_precision_reference_and_a_proxy_are_named_with_what_they_cost_the_claims():
    found = records(
        {"cell": "engine-k4-T1-bf16", "mode": "one-sample", "precision": "bf16"},
        {"cell": "engine-k4-greedy-bf16", "mode": "engine-greedy", "precision": "bf16"},
        {"cell": "engine-k4-T1", "mode": "one-sample", "precision": "fp32"},
        {"cell": "engine-k4-T1-q4", "mode": "two-sample", "proxy_precision": "bf16"},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "- 1 one-sample engine cell scored by losscheck's copy of the target in bf16 (engine-k4-T1-bf16)" in text
    assert "logit tolerance (0.3 nats; not measured per kernel)" in text
    assert "- 1 two-sample engine cell sized through a proxy, losscheck's copy of the target in bf16" in text
    fp32 = "\n".join(claims.lines(certificate_of(records({"cell": "engine-k4-T1", "mode": "one-sample"}))))
    assert "scored by losscheck's copy" not in fp32 and "through a proxy" not in fp32


def test_the_ends_inside_blocks_are_counted_and_the_cell_with_most_named():
    def hazard(cell: str, rho: float | None) -> dict:
        result = result_json("pit.stop_hazard", 4000, detectable={"stop_loss_share": rho})
        return verdict_json(cell, result)

    found = records(
        {"cell": "A-k4-T1", "ends": 3, "ends_in_block": 3, "verdict": hazard("A-k4-T1", None)},
        {
            "cell": "A-k4-T1-min8-stop25",
            "ends": 59,
            "ends_in_block": 53,
            "verdict": hazard("A-k4-T1-min8-stop25", 0.73),
        },
        {
            "cell": "A-k4-T1-stopstr_rR",
            "ends": 0,
            "ends_in_block": 0,
            "string_ends": 40,
            "string_ends_in_block": 31,
            "verdict": hazard("A-k4-T1-stopstr_rR", 0.9),
        },
        {"cell": "A-k4-greedy", "kind": "greedy"},
    )
    text = "\n".join(claims.lines(certificate_of(found)))
    assert "- rows ending on EOS or a stop id in 3 sampled cells: 62, 56 of them with drafted positions" in text
    assert "rows ending on a stop string in 1 cell: 40, 31 of them inside a block" in text
    assert "most in A-k4-T1-min8-stop25: 53 of 59" in text
    assert (
        "every end's probability) in A-k4-T1-min8-stop25 (0.90 of its ends in a "
        "block, detectable 0.73); not covered in A-k4-T1 (1.00 of its ends in a block, detectable none)" in text
    ), text
    assert "rows ending on EOS" not in "\n".join(claims.lines(certificate_of(records({"cell": "x"}))))
