"""Test support, defined once: closed-form toy models (Markov tables, tiny random Llamas), the toy
engine's prompts and noisy drafter, a black-box engine's request, the χ² check of sampled ids
against a known law, and the check of a written certificate against its published schema, and the
run of the shipped certify tests for a black-box engine in a process of its own."""

from __future__ import annotations

import copy
import json
import math
import sys
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from scipy.stats import chisquare

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams
    from losscheck.core.target import HFTarget
    from losscheck.drafters.autoregressive import AutoregressiveDrafter
    from losscheck.engines import GenerationRequest

ROOT = Path(__file__).resolve().parents[1]  # the repository's root, whatever a test file's depth

# Ragged prompts for the tiny Llamas (vocabulary 32, BOS 0): rows of different lengths share a batch.
PROMPTS = [[0], [0, 5], [0, 7, 9, 11], [0, 3, 3, 3, 3, 3, 3], [0, 20, 21], [0, 9, 8, 7, 6, 5, 4, 3, 2]]


def few_prompts(path: Path, per_tier: int = 2) -> Path:
    """A JSONL prompt file (`--prompts`) of the first `per_tier` bundled prompts of each tier: for
    a test whose claim is that an integration runs and passes a cell, not the cell's full sample
    (a generator that decodes one row per call pays per prompt; the main job runs all 48)."""
    from losscheck import bundled

    with path.open("w") as file:
        for tier in ("low", "mid", "high"):
            for ids in bundled.load_prompts(tier)[:per_tier]:
                file.write(json.dumps({"ids": ids, "tier": tier}) + "\n")
    return path


def engine_request(
    prompts: list[list[int]], n: int, params: SamplingParams, seed: int, max_new_tokens: int, speculative: bool
) -> GenerationRequest:
    """A black-box engine's request, its fields in the old contract's order (tests only)."""
    from losscheck.engines import GenerationRequest

    fields = ("prompts", "n", "params", "seed", "max_new_tokens", "speculative")
    return GenerationRequest(**dict(zip(fields, (prompts, n, params, seed, max_new_tokens, speculative))))


def markov_table(vocab: int, generator: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    """A random next-token logit table [V, V]: row = previous token."""
    return torch.randn(vocab, vocab, generator=generator, dtype=torch.float64) * sharpness


def markov_chain(
    vocab: int, seed: int, sharpen: float = 1.0, impossible: float = 0.0, absorbing: int | None = None
) -> torch.Tensor:
    """Next-token probabilities [V, V] (row = last token): softmax(sharpen · 1.5-scale logits), with
    a share `impossible` of transitions at probability 0 (column 0 kept possible) and `absorbing`
    (e.g. EOS) a point mass on itself."""
    gen = torch.Generator().manual_seed(seed)
    logits = markov_table(vocab, gen, sharpness=1.5)
    if impossible:
        logits[torch.rand(vocab, vocab, generator=gen) < impossible] = -math.inf
        logits[:, 0] = 0.0  # every row keeps a possible token
    table = torch.softmax(sharpen * logits, -1)
    if absorbing is not None:
        table[absorbing] = 0.0
        table[absorbing, absorbing] = 1.0
    return table


def tiny_llama(
    vocab: int = 32,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    max_positions: int = 128,
    eos: int = 1,
    scale: float = 8.0,
) -> torch.nn.Module:
    """A random-weight Llama whose logits are scaled up so greedy decoding has clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def tiny_target(max_positions: int = 128, attention_scale: float = 1.0) -> HFTarget:
    """`tiny_llama` as the fp32 target "toy", query and key projections scaled by `attention_scale`."""
    from losscheck.core.target import HFTarget

    model = tiny_llama(max_positions=max_positions)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(attention_scale)
            layer.self_attn.k_proj.weight.mul_(attention_scale)
    return HFTarget(model, "toy", {"precision": "fp32"})


def noisy_drafter(target: HFTarget, noise: float, seed: int = 1) -> AutoregressiveDrafter:
    """A copy of the target's model, each weight perturbed by `noise` × its tensor's std (seeded)."""
    from losscheck.drafters.autoregressive import AutoregressiveDrafter

    model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return AutoregressiveDrafter(model, "noisy")


def chi_square_p(tokens: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson χ² p-value of ids `tokens` [n] against `law` [V], bins of < 5 expected pooled (chosen
    from the law, never from the counts); asserts first that no id outside the law's support was drawn."""
    counts = torch.bincount(tokens, minlength=law.shape[0]).double()  # [V]
    outside = int(counts[law == 0].sum())
    assert outside == 0, f"{outside} of {len(tokens)} ids have probability 0 under the law"
    expected = law.double() * len(tokens)  # [V]
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def assert_follows(tokens: torch.Tensor, law: torch.Tensor, alpha: float, what: str = "ids") -> None:
    """Assert ids `tokens` [n] follow `law` [V]: χ² p > `alpha`. A correct sampler fails one call
    with probability `alpha`; a module calling it m times fails with probability <= m · alpha
    (union bound), and each calling module states that total where it sets its `alpha`."""
    p = chi_square_p(tokens, law)
    assert p > alpha, (
        f"{what}: χ² p = {p:.3g} <= {alpha:g} over n = {len(tokens)}: H0 (the ids follow the law) "
        f"rejected; false-failure probability {alpha:g} per call"
    )


def certificate_errors(cert: dict) -> list[str]:
    """Where `cert` breaks the published schema (losscheck/report/certificate.schema.json), one
    line per violation: path in the certificate, then jsonschema's message."""
    from jsonschema import Draft202012Validator  # the test extra's: imported by the tests that check certificates

    schema = json.loads(files("losscheck.report").joinpath("certificate.schema.json").read_text())
    errors = sorted(Draft202012Validator(schema).iter_errors(cert), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message[:300]}" for e in errors]


def assert_valid_certificate(cert: dict) -> dict:
    """Assert `cert` (a certificate as written, read back from its JSON) follows the published
    schema; return it."""
    errors = certificate_errors(cert)
    assert not errors, "the certificate breaks certificate.schema.json:\n" + "\n".join(errors)
    return cert


def acceptance_json(tau: float = 3.0, rounds: int = 10, k: int = 4) -> dict:
    """A prompt group's loop counters in the certificate's JSON form: `rounds` rounds emitting
    `tau` tokens each on average (the accepted drafts spread over the first slots)."""
    accepted = [min(rounds, max(0, round((tau - 1) * rounds - j * rounds))) for j in range(k)]
    return {
        "k": k,
        "acceptance_length": tau,
        "slot_acceptance": [a / rounds for a in accepted],
        "proposed": [rounds] * k,
        "accepted": accepted,
        "wasted_fraction": 0.0,
        "row_rounds": rounds,
        "draft_seconds": 0.1,
        "target_seconds": 0.2,
        "total_seconds": 0.3,
        "draft_time_fraction": 1 / 3,
    }


def cell_record(cell: str, outcome: str = "passed", **fields: object):
    """A hand-made `CellRecord`, `fields` given in the certificate's JSON form (so a test reads
    as the certificate does); read through `CellRecord.from_json`, which checks every value."""
    from losscheck.cells.record import CellRecord

    return CellRecord.from_json(
        {"cell": cell, "nodeid": f"test_cells.py::test_cell[{cell}]", "outcome": outcome, **fields}
    )


def verdict_json(cell: str, *results: dict, alpha: float = 0.01) -> dict:
    """A sampled cell's verdict in the certificate's JSON form."""
    return {"cell": cell, "alpha": alpha, "passed": all(r["passed"] for r in results), "results": list(results)}


def result_json(name: str, n: int, p_value: float = 0.5, alpha: float = 0.001, **fields: object) -> dict:
    """One statistical test's result in the certificate's JSON form."""
    result = {
        "name": name,
        "expected": "uniform",
        "observed": "uniform",
        "statistic": 1.0,
        "p_value": p_value,
        "alpha": alpha,
        "n": n,
        "power": 0.99,
        "passed": p_value > alpha,
        "detectable": {"tv": 0.05},
        "scope": "pooled",
    }
    return {**result, **fields}


ENVIRONMENT = {
    "losscheck": "0.1.0",
    "git_revision": None,
    "python": "3.11",
    "platform": "Linux",
    "machine": "x86_64",
    "cpu_count": 2,
    "torch": "2.13",
    "transformers": "5",
    "numpy": "2",
    "scipy": "1",
    "device": "cpu",
    "accelerator": "cpu (x86_64)",
    "worker": "gw0",
    "threads": 1,
}


def manifest_record(matrix: list[dict], worker: str = "gw0", out: list[dict] | None = None, **fields: object):
    """A hand-made process manifest (`losscheck.report.manifest.Manifest`), `matrix` and `fields`
    in its JSON form, the rest filled with plausible values."""
    from losscheck.report.manifest import Manifest

    doc = {
        "matrix": matrix,
        "alpha": {"family": 0.01, "statistical_tests": 1, "per_test": 0.01},
        "targets": {"main": {"path": "t", "sha256": "a" * 64, "precision": "fp32"}},
        "drafters": {"main": {"A": {"name": "A", "sha256": "b" * 64}}},
        "engine": None,
        "scope": {"declared": "all", "out": out or []},
        "environment": {**ENVIRONMENT, "worker": worker},
    }
    return Manifest.from_json({**doc, **fields})


def run_shipped(
    pytester: pytest.Pytester,
    *args: str,
    module: str = "losscheck.plugin.certify",
    in_process: bool = False,
    **kwargs: float,
) -> pytest.RunResult:
    """The shipped certify tests (`module`, by default all of them) with `args`, without the cache
    plugin, in a pytest process of its own; `kwargs` go to `runpytest_subprocess` (its `timeout`).
    `in_process`: in this one instead (`run_in_process`), where no process boundary is the claim."""
    args = ("--pyargs", module, "-p", "no:cacheprovider", *args)
    return run_in_process(pytester, *args) if in_process else pytester.runpytest_subprocess(*args, **kwargs)


def run_in_process(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """`pytester.runpytest_inprocess`, keeping the third-party modules the run imports: pytester
    drops every module a run imported, and transformers' lazy modules do not survive that (its
    next import of a model fails). losscheck's own modules and the test directory's are still
    dropped, so each run imports them afresh, as a process of its own would. A run saves the 5-10 s
    of a process's imports and collection (the e2e tier's largest cost; docs/figures.md). What the
    run's own modules register (an engine adapter, a statistical test) stays in the registries of
    the modules this process had already imported: a run that registers needs a process."""
    from unittest import mock

    from _pytest.pytester import SysModulesSnapshot

    here = str(pytester.path)

    def kept(name: str) -> bool:
        module = sys.modules.get(name)
        own = name == "losscheck" or name.startswith("losscheck.")
        return not own and not str(getattr(module, "__file__", None) or "").startswith(here)

    def snapshot(self: pytest.Pytester) -> SysModulesSnapshot:
        return SysModulesSnapshot(preserve=kept)

    # pytester snapshots sys.modules twice, private both: around the run and for the test's teardown
    pytester._sys_modules_snapshot = snapshot(pytester)
    with mock.patch.object(pytest.Pytester, "_Pytester__take_sys_modules_snapshot", snapshot):
        return pytester.runpytest_inprocess(*args)


def certify_engine(
    pytester: pytest.Pytester, engine: str, select: str, *args: str, **kwargs: float
) -> pytest.RunResult:
    """The shipped certify tests selected by `select` (`-k`) for `--losscheck-engine=engine`."""
    return run_shipped(pytester, "-k", select, f"--losscheck-engine={engine}", *args, **kwargs)


def verified_q(engine: object, request: object) -> torch.Tensor:
    """The q that Hugging Face assisted generation hands its verifier (`_speculative_sampling`'s
    candidate logits) over one `engine.generate(request)`: [1, rounds * k, V]."""
    from unittest import mock

    from transformers.generation import utils

    verify = utils._speculative_sampling
    seen: list[torch.Tensor] = []

    def spy(ids, q, *args, **kwargs):
        seen.append(q.detach().clone())  # [1, k, V]
        return verify(ids, q, *args, **kwargs)

    with mock.patch.object(utils, "_speculative_sampling", spy):
        engine.generate(request)  # type: ignore[attr-defined]
    assert seen, "assisted generation never verified a draft"
    return torch.cat(seen, dim=1)


def topk_request(k: int = 8, temperature: float = 0.3):
    """One row of 12 tokens after a short prompt at `temperature` and top-k `k`, drafting on."""
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

    params = SamplingParams(temperature=temperature, top_k=k)
    return GenerationRequest(prompts=((1, 2, 3),), n=1, params=params, seed=7, max_new_tokens=12, speculative=True)
