"""A user's lossy drafter, named as `--losscheck-drafter=module:factory` names it, fails its sampled
cell of family A (in process, at the α share the full matrix gives each test; the e2e tier runs an
honest user's drafter through the plugin). Each bug moves the law by more than the cell's
detectable TV, so a pass has probability <= 1 - 0.99 (the gate's power)."""

from __future__ import annotations

import dataclasses

import pytest

from losscheck import bundled
from losscheck.core.sampling import process_logits
from losscheck.drafters.autoregressive import AutoregressiveDrafter, from_path


class ArgmaxWithSoftmaxQ(AutoregressiveDrafter):
    """Proposes its argmax but reports its softmax as q (a real bug of a popular library)."""

    def draw(self, logits, ctx):
        q = process_logits(logits, ctx.params)
        return q.argmax(-1), q


class WrongTemperatureQ(AutoregressiveDrafter):
    """Samples at the request's temperature but reports q at temperature 1."""

    def draw(self, logits, ctx):
        token, _ = super().draw(logits, ctx)
        return token, process_logits(logits, dataclasses.replace(ctx.params, temperature=1.0))


def softmax_q_for_argmax(target):
    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return ArgmaxWithSoftmaxQ(honest.lm.model, "argmax-softmax-q")


def q_at_t1(target):
    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return WrongTemperatureQ(honest.lm.model, "q-at-T1")


@pytest.mark.parametrize(
    "factory, cell", [("softmax_q_for_argmax", "user-k4-T1"), ("q_at_t1", "user-k4-T0.3")], ids=["softmax-q", "q-at-T1"]
)
def test_a_lossy_user_drafter_fails_its_sampled_cell(factory, cell, one_thread):
    from losscheck.cells.sampled import run_pit
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(drafter=f"{__name__}:{factory}"))
    (planned,) = [c for cells in session.plan.values() for c in cells if c.id == cell]
    outcome = run_pit(CellContext.of(session, planned))
    assert not outcome.passed, f"{factory}: {cell} passed (probability <= 0.01 for this bug)\n{outcome.message()}"
    assert outcome.verdict is not None
    failed = [t for t in outcome.verdict.results if t.p_value is not None and t.p_value <= t.alpha]
    assert any(t.name.startswith("pit.") for t in failed), outcome.message()  # the law's tests, not only q's
