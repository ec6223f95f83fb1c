"""Bad inputs, as a user types them: each is one message naming the input and the fix, with the
documented exit status (2 for anything caught before the run), never a traceback. The cases are
the table of docs/errors.md: a test checks that the page lists every case with its message and
exit status, so the page cannot drift from what the command does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from losscheck import bundled
from losscheck.cli import main
from tests.support import ROOT, cell_record, manifest_record

DOC = ROOT / "docs" / "errors.md"

NOT_A_DRAFTER = "def factory(target):\n    return 42\n"
WRONG_SHAPE_ENGINE = """import torch


class WrongShape:
    name, k, precision = "wrong-shape", 4, None

    def generate(self, request):
        return torch.zeros(len(request.prompts), request.max_new_tokens, dtype=torch.long)  # no n axis


def factory(target):
    return WrongShape()
"""


def model_dir(path: Path, **config: object) -> None:
    """A model directory whose config.json is the bundled target's with `config` changed, and an
    empty weights file (what the start-up check reads)."""
    path.mkdir(parents=True)
    base = json.loads((bundled.target_path() / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**base, **config}))
    (path / "model.safetensors").write_bytes(b"")


def certificate_run(path: Path, drafters: dict, schema: str = "losscheck.certificate/2") -> None:
    """A run directory `path` holding a certificate of `drafters` on the bundled target."""
    from losscheck.report import certificate
    from losscheck.run.options import Options

    manifest = manifest_record(
        [{"cell": "A-k4-greedy", "mode": "greedy", "argument": "greedy_cell"}],
        "main",
        alpha={"family": 0.01, "statistical_tests": 0, "per_test": None},
        targets={"main": {"path": "bundled:target", "sha256": "a" * 64, "precision": "fp32"}},
        drafters={"main": drafters},
    )
    record = cell_record("A-k4-greedy", kind="greedy", passed=True)
    cert = certificate.build(certificate.run_meta(Options(), []), [manifest], [record], 0, False)
    path.mkdir(parents=True)
    (path / "certificate.json").write_text(json.dumps({**cert.to_json(), "schema": schema}, default=str))


def setup_files(cwd: Path) -> None:
    """Everything the cases name, in the directory they run in."""
    (cwd / "mydrafter.py").write_text(NOT_A_DRAFTER)
    (cwd / "badengine.py").write_text(WRONG_SHAPE_ENGINE)
    model_dir(cwd / "big_vocab_drafter", vocab_size=1000)
    model_dir(cwd / "big_vocab_target", vocab_size=1000)
    (cwd / "prompts.jsonl").write_text('{"ids": [1, 2, 3]}\n{not json\n')
    (cwd / "long.jsonl").write_text(json.dumps({"ids": [1] * 250}) + "\n")
    (cwd / "taken").write_text("a file")
    certificate_run(cwd / "reports" / "run_a", {"A": {"name": "A:drafter_a", "class": "A", "sha256": "b" * 64}})
    certificate_run(cwd / "reports" / "run_b", {"user": {"name": "user:mine", "class": "Mine", "sha256": "c" * 64}})
    certificate_run(cwd / "old", {"A": {"name": "A"}}, schema="losscheck.certificate/1")


@dataclass(frozen=True)
class Case:
    what: str  # the table's first column: the bad input, in words
    argv: tuple[str, ...]  # after `losscheck`
    exit: int
    message: str  # a distinctive part of the message's first line (of stderr, or of the cell's error)
    subprocess: bool = False  # runs pytest (a plan error, a cell's error): in its own process
    marks: tuple = field(default=())

    @property
    def command(self) -> str:
        return "losscheck " + " ".join(a if a and " " not in a else repr(a) for a in self.argv)


CASES = [
    Case(
        "a target directory that does not exist",
        ("certify", "--target", "models/nope"),
        2,
        "losscheck certify: error: --target='models/nope': no such directory; pass a local Hugging Face model "
        "directory",
    ),
    Case(
        "a typo in the drafter's module",
        ("certify", "--drafter", "my_drafter:factory"),
        2,
        "losscheck certify: error: --drafter='my_drafter:factory': cannot import module 'my_drafter'",
    ),
    Case(
        "a typo in the drafter's factory",
        ("certify", "--drafter", "mydrafter:factroy"),
        2,
        "losscheck certify: error: --drafter='mydrafter:factroy': module 'mydrafter' has no attribute 'factroy'",
    ),
    Case(
        "a drafter directory of another vocabulary",
        ("certify", "--drafter", "big_vocab_drafter"),
        2,
        "--drafter='big_vocab_drafter' has a vocabulary of 1000 tokens, the bundled target 64; a drafter must "
        "share the target's vocabulary",
    ),
    Case(
        "your target, no drafter named (the bundled drafters do not fit it)",
        ("certify", "--target", "big_vocab_target"),
        2,
        "--target='big_vocab_target' has a vocabulary of 1000 tokens and hidden size 128; the bundled drafters",
    ),
    Case(
        "a malformed line in the prompt file",
        ("certify", "--prompts", "prompts.jsonl"),
        2,
        "losscheck certify: error: --prompts='prompts.jsonl' line 2: not JSON",
    ),
    Case(
        "a prompt longer than the target's positions allow",
        ("certify", "--prompts", "long.jsonl"),
        2,
        "--prompts='long.jsonl' line 1: the prompt is 250 tokens long; with the 64 tokens a cell generates "
        "after it, that exceeds the target's 256 positions",
    ),
    Case(
        "an unknown precision",
        ("certify", "--precision", "fp8"),
        2,
        "losscheck certify: error: argument --precision: target precision 'fp8' is not one of",
    ),
    Case(
        "an empty precision list",
        ("certify", "--precision", ""),
        2,
        "losscheck certify: error: argument --precision: '' names no precision",
    ),
    Case(
        "a precision named twice",
        ("certify", "--precision", "fp32,fp32"),
        2,
        "losscheck certify: error: argument --precision: 'fp32,fp32' names fp32 twice",
    ),
    Case(
        "an alpha outside (0, 1)",
        ("certify", "--alpha", "2"),
        2,
        "losscheck certify: error: argument --alpha: must be in (0, 1), got 2",
    ),
    Case(
        "a repetition penalty of 0 (a penalty must be > 0)",
        ("certify", "--sampling", "repetition_penalty=0"),
        2,
        "repetition_penalty must be a finite number > 0 (1 = off), got 0.0",
    ),
    Case(
        "a min-p outside [0, 1]",
        ("certify", "--sampling", "min_p=1.5"),
        2,
        "min_p must be in [0, 1] (0 = off), got 1.5",
    ),
    Case(
        "a logit-bias id outside the target's vocabulary",
        ("certify", "--sampling", "logit_bias=99:2"),
        2,
        "logit_bias names ids [99] outside the vocabulary of the target [0, 64)",
    ),
    Case(
        "a sampling parameter losscheck does not know",
        ("certify", "--sampling", "frobnicate=1"),
        2,
        "'frobnicate=1' is not NAME=VALUE with NAME one of temperature",
    ),
    Case(
        "a grammar that does not compile",
        ("certify", "--sampling", "grammar=regex:([a-z]"),
        2,
        "grammar regex:'([a-z]' does not compile: Regex parsing error at position 7",
    ),
    Case(
        "an unknown planted bug",
        ("certify", "--mutant", "no_such_bug"),
        2,
        "losscheck certify: error: argument --mutant: --mutant='no_such_bug' is not a registered planted bug",
    ),
    Case(
        "an output directory that is a file",
        ("certify", "--out", "taken"),
        2,
        "losscheck certify: error: --out='taken': ",
    ),
    Case(
        "a directory of runs instead of a run",
        ("report", "reports"),
        2,
        "losscheck report: error: 'reports' is not a run directory: it has no certificate.json; the runs in it:",
    ),
    Case(
        "a run directory that does not exist",
        ("report", "reports/run_c"),
        2,
        "losscheck report: error: 'reports/run_c': no such file or directory",
    ),
    Case(
        "a certificate of another schema version",
        ("report", "old"),
        2,
        "losscheck report: error: 'old/certificate.json' has schema 'losscheck.certificate/1'; this losscheck reads",
    ),
    Case(
        "two certificates of different drafters",
        ("compare", "reports/run_a", "reports/run_b"),
        2,
        "losscheck compare: error: the certificates are of different things, so their differences are not a change: "
        "drafters on main: A before, user after",
    ),
    Case(
        "a drafter factory that returns no drafter (found once the target loads)",
        ("certify", "--drafter", "mydrafter:factory", "-n", "0"),
        2,
        "ERROR: --drafter='mydrafter:factory' returned int, which lacks",
        subprocess=True,
        marks=(pytest.mark.e2e,),
    ),
    Case(
        "an engine whose generate returns the wrong shape (a FAIL: its cells error)",
        ("certify", "--engine", "badengine:factory", "-n", "0", "--", "-k", "engine-k4-greedy"),
        1,
        "engine 'wrong-shape': generate returned shape (16, 64), expected [prompts, n, max_new_tokens] = (16, 1, 64)",
        subprocess=True,
        marks=(pytest.mark.e2e,),
    ),
]


def run(case: Case, cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr and stdout) of `losscheck` with `case.argv`, run in `cwd`."""
    if case.subprocess:
        done = subprocess.run(
            [sys.executable, "-m", "losscheck.cli", *case.argv],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        )
        return done.returncode, done.stderr + done.stdout
    try:
        status = main(list(case.argv))
    except SystemExit as exc:  # argparse's usage errors
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    return status, captured.err + captured.out


@pytest.mark.parametrize("case", [pytest.param(c, id=c.what, marks=c.marks) for c in CASES])
def test_a_bad_input_is_one_message_and_its_exit_status(case, tmp_path, monkeypatch, capsys):
    setup_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mydrafter", raising=False)
    status, out = run(case, tmp_path, capsys)
    assert status == case.exit, out[-4000:]
    assert case.message in out, out[-4000:]
    assert "Traceback" not in out or case.exit == 1, out[-4000:]  # a cell's error is pytest's test report
    if case.exit == 2:
        errors = [line for line in out.splitlines() if re.match(r"(losscheck \w+: error|ERROR): ", line)]
        assert len(errors) == 1, out[-4000:]


def doc_rows() -> dict[str, tuple[str, str]]:
    """The table of docs/errors.md: command -> (message column, exit column)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 4 and cells[1].startswith("`losscheck "):
            rows[cells[1].strip("`")] = (cells[2], cells[3])
    return rows


def test_the_docs_table_lists_every_case_with_its_message_and_exit_status():
    rows = doc_rows()
    assert len(CASES) >= 12 and len(rows) == len(CASES), sorted(rows)
    for case in CASES:
        assert case.command in rows, f"docs/errors.md has no row for `{case.command}`"
        message, status = rows[case.command]
        shown = message.strip("`").replace("\\|", "|")
        assert status == str(case.exit), f"`{case.command}`: the page says exit {status}, the command exits {case.exit}"
        assert case.message.split(": error: ")[-1][:60] in shown, f"`{case.command}`: the page shows {shown!r}"


def test_an_engine_returning_the_wrong_shape_is_named_with_both_shapes():
    """The engine's output check itself (the case above runs it end to end, slowly)."""
    import torch

    from losscheck.core.sampling import GREEDY
    from losscheck.engines import EngineOutputError, GenerationRequest, checked_samples

    class Engine:
        name, k, precision = "wrong-shape", 4, None

    request = GenerationRequest(prompts=[[0]] * 3, n=2, params=GREEDY, seed=0, max_new_tokens=8, speculative=True)
    with pytest.raises(EngineOutputError) as error:
        checked_samples(Engine(), torch.zeros(3, 8, dtype=torch.long), request, vocab_size=64, eos=1)  # type: ignore[arg-type]
    assert str(error.value) == (
        "engine 'wrong-shape': generate returned shape (3, 8), expected [prompts, n, max_new_tokens] = (3, 2, 8)"
    )
    with pytest.raises(EngineOutputError, match="generate returned list, expected a LongTensor"):
        checked_samples(Engine(), [[1, 2]], request, vocab_size=64, eos=1)  # type: ignore[arg-type]
