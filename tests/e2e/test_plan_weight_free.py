"""Planning reads declarations, never weights: collecting the main job's tests (what every pytest
process and xdist worker does before a cell runs) and `losscheck certify --list` load no model."""

from __future__ import annotations

import re

import pytest
import safetensors
import safetensors.torch
from transformers import PreTrainedModel  # imported before pytester's snapshot of sys.modules

from losscheck.run.options import Options
from losscheck.run.session import Session

pytest_plugins = ["pytester"]


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read fails the test: Hugging Face's loaders and safetensors' readers."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded while planning")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)


NO_WEIGHTS_PLUGIN = """
import safetensors, safetensors.torch
from transformers import PreTrainedModel

def refuse(*args, **kwargs):
    raise AssertionError("weights loaded while planning")

PreTrainedModel.from_pretrained = classmethod(refuse)
safetensors.torch.load_file = safetensors.safe_open = refuse
"""


def test_the_main_jobs_collection_loads_no_weights_and_collects_the_planned_cells(pytester):
    """A pytest process of its own (as every xdist worker is), its weight loaders refusing."""
    pytester.makepyfile(noweights=NO_WEIGHTS_PLUGIN)
    pytester.syspathinsert()
    args = ("-p", "noweights", "-p", "no:cacheprovider", "--pyargs", "losscheck.plugin.certify", "--collect-only", "-q")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0, result.stdout.str()[-3000:]
    collected = {m.group(1) for line in result.stdout.lines if (m := re.search(r"\[(.+)\]$", line))}
    planned = {c.id for cells in Session(Options(), skeleton=True).plan.values() for c in cells}
    assert planned and planned <= collected, sorted(planned - collected)[:5]


def test_a_run_sessions_plan_is_the_list_plan_without_weights(no_weights):
    for bundled in ("reference", "all"):
        run, listed = Session(Options(bundled=bundled)), Session(Options(bundled=bundled), skeleton=True)
        assert run.plan == listed.plan and run.plan
        assert run.prompt_sets  # the bundled prompts, read without the target's weights
