"""`losscheck compare` compares certificates of the same things only, and `losscheck report` reads a
run directory or its certificate.json, nothing standing in for one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from losscheck.cli import main
from losscheck.report import certificate, compare
from losscheck.report.document import Certificate
from tests.support import assert_valid_certificate
from tests.unit.report.test_certificate import build, manifest, record

DIFFERENT = "the certificates are of different things"


def cert(tau: float = 3.0, passed: bool = True) -> dict:
    """A certificate in its JSON form (the tests change it as a file would differ)."""
    records = [record("A-k4-greedy", tau=tau), record("A-k4-T1", passed=passed)]
    return build([manifest()], records, int(not passed)).to_json()


def typed(c: dict) -> Certificate:
    return Certificate.from_json(json.loads(json.dumps(c)))


def changed(base: dict, change) -> dict:
    other = copy.deepcopy(base)
    change(other)
    return other


def drafter(c: dict) -> dict:
    return c["drafters"]["main"]["A"]


def engine(c: dict) -> dict:
    return c["engine"]


def pinned(c: dict) -> dict:
    """`c` as an engine certificate that pins its engine and runtime."""
    draft = {"path": "drafter_a32", "sha256": "d" * 64}
    identity = {"name": "vllm", "k": 4, "package": {"vllm": "0.32.0"}, "draft_model": draft, "options": {"seed": 0}}
    runtime = {"torch": "2.13.0", "cuda": "13.0", "driver": "580.1", "device_count": 1}
    return changed(c, lambda d: (d.update(engine=identity), d["environment"].update(runtime)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["targets"]["main"].update(sha256="c" * 64), "target main: sha256 aaaaaaaaaaaa… before, cccccc"),
        (lambda c: c["drafters"]["main"].update(E=drafter(c)), "drafters on main: A before, A, E after"),
        (lambda c: drafter(c).update({"class": "my.Drafter"}), "drafter A on main: class None before, 'my.Drafter'"),
        (lambda c: c.update(engine={"name": "hf", "k": 4}), "black-box engine: none before, hf after"),
        # the same engine pinned differently (losscheck.engines.pins), and another runtime
        (lambda c: engine(c)["package"].update(vllm="0.33.0"), "engine package: {'vllm': '0.32.0'} before"),
        (lambda c: engine(c)["draft_model"].update(sha256="f" * 64), "engine draft model: sha256 dddddddddddd…"),
        (lambda c: engine(c)["options"].update(seed=1), "engine options: {'seed': 0} before, {'seed': 1} after"),
        (lambda c: c["environment"].update(torch="2.14.1"), "torch: 2.13.0 before, 2.14.1 after"),
        (lambda c: c["environment"].update(device_count=2), "device_count: 1 before, 2 after"),
    ],
)
def test_certificates_of_different_things_are_refused_unless_allowed(change, message):
    a = cert()
    if message.startswith(("engine ", "torch", "device_count")):
        a = pinned(a)
    b = changed(a, change)
    with pytest.raises(compare.DifferentRunsError, match=DIFFERENT) as error:
        compare.report(typed(a), typed(b))
    assert message in str(error.value) and "pass --allow-different" in str(error.value)
    text, regressed = compare.report(typed(a), typed(b), allow_different=True)
    warning = text.splitlines()[2]  # after the title: what differs
    assert warning.startswith("- WARNING: not the same run's things: ") and message in warning and not regressed


def test_a_drafter_with_new_weights_is_compared_as_a_new_release_and_said_so():
    a = cert(tau=3.0)
    b = changed(cert(tau=3.5), lambda c: drafter(c).update(sha256="d" * 64))
    text, regressed = compare.report(typed(a), typed(b))
    assert "- CHANGED: drafter A on main: weights bbbbbbbbbbbb… before, dddddddddddd… after" in text
    assert "| A-k4-greedy | passed | passed | 3.000 | 3.500 | +0.500 |" in text and not regressed
    assert "CHANGED" not in compare.report(typed(a), typed(cert(tau=3.5)))[0]  # the same drafter: nothing to say


def test_a_pin_only_one_certificate_records_is_not_compared():
    """A certificate written before the pins (no package, draft model or CUDA recorded) against
    one that has them: nothing to refuse, nothing claimed."""
    new = pinned(cert())
    old = changed(
        new,
        lambda c: (
            [c["engine"].pop(k) for k in ("package", "draft_model", "options")],
            [c["environment"].pop(k) for k in ("cuda", "driver", "device_count")],
        ),
    )
    assert compare.identity_differences(typed(old), typed(new)) == ([], [])


def test_the_oracle_and_targets_only_one_run_has_do_not_make_runs_different():
    a = cert()
    b = changed(a, lambda c: (c["targets"].update(small={"sha256": "e" * 64}), c["drafters"]["main"].pop("self", 0)))
    a["drafters"]["main"]["self"] = {"name": "self-draft", "class": "x.SelfDraft"}
    assert compare.identity_differences(typed(a), typed(b)) == ([], [])


def write(tmp_path: Path, name: str, c: dict) -> Path:
    return certificate.write_run(tmp_path / name, typed(c))


def test_compare_exits_2_on_different_targets_and_compares_them_when_allowed(tmp_path, capsys):
    a = write(tmp_path, "a", cert())
    b = write(tmp_path, "b", changed(cert(passed=False), lambda c: c["targets"]["main"].update(sha256="c" * 64)))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"losscheck compare: error: {DIFFERENT}") and err.count("\n") == 1, err
    assert main(["compare", str(a), str(b / "certificate.json"), "--allow-different"]) == 1  # regressed
    assert "- WARNING: not the same run's things: target main" in capsys.readouterr().out


def test_report_rerenders_a_run_directory_or_its_certificate(tmp_path, capsys):
    run = write(tmp_path, "reports", cert())
    (run / "summary.md").unlink()
    for given in (run, run / "certificate.json"):
        assert main(["report", str(given)]) == 0
        assert (run / "summary.md").is_file() and "losscheck verdict: PASS" in capsys.readouterr().out
    assert_valid_certificate(json.loads((run / "certificate.json").read_text()))


@pytest.mark.parametrize(
    "given, message",
    [
        ("reports", "'{d}/reports' is not a run directory: it has no certificate.json; the runs in it: '{d}/reports/"),
        ("reports/nope", "'{d}/reports/nope': no such file or directory; name a run directory"),
        ("empty", "'{d}/empty' is not a run directory: it has no certificate.json; name a run directory"),
    ],
)
def test_report_of_what_is_not_a_run_is_an_error_and_writes_nothing(tmp_path, capsys, given, message):
    run = write(tmp_path, "reports", cert())
    (tmp_path / "empty").mkdir()
    (tmp_path / "certificate.json").write_text((run / "certificate.json").read_text())  # a parent to fall back to
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["report", str(tmp_path / given)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("losscheck report: error: " + message.format(d=tmp_path)), err
    assert sorted(p for p in tmp_path.rglob("*")) == before
