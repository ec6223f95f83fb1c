"""The `--losscheck-*` options, defined once for the pytest plugin and the `losscheck` CLI.

As pytest-benchmark does, one table declares every option; `add_options` hands it to pytest's
`addoption` (prefix `--losscheck-`) or to argparse's `add_argument` (prefix `--`), both storing
under the same `dest`, so `from_parsed` builds `Options` the same way from either.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, TypeVar

from losscheck.core.precision import DEVICES, Precision, parse_precisions
from losscheck.errors import OptionError, flag
from losscheck.plan.arrivals import parse_arrivals, parse_block_lengths, parse_concurrency
from losscheck.plan.perf_profiles import DEFAULT_COMPARE_FAIL, PERF_PROFILES, parse_thresholds
from losscheck.plan.profiles import PROFILES, Profile, get_profile
from losscheck.plan.scope import Scope, parse_scope
from losscheck.plan.shard import Shard, parse_shard

T = TypeVar("T")

DEFAULT_SEED = 20261129
DEFAULT_ALPHA = 0.01
DEFAULT_PROFILE = "ci"
DEFAULT_MEMORY_BUDGET_MIB = 2048
# The base cell's precision first, then one cell per other entry (bundled drafter A and a user's
# drafters); "bf16/fp32" is target bf16 with drafter fp32.
DEFAULT_PRECISIONS = "fp32,bf16,fp16,bf16/fp32"
DEFAULT_PERF_PROFILE = "quick"
# Without a drafter of the user's: the reference drafter (family A; the self-draft oracle always
# comes too), every bundled family, or the cells of every family the reference set leaves out
# ("others": with the main job, the whole bundled matrix once). The plugin's default is every
# family; `losscheck certify`, the main job, defaults to the reference drafter.
BUNDLED = ("reference", "all", "others")
DEFAULT_BUNDLED = "all"


@dataclass(frozen=True)
class Options:
    """Parsed `--losscheck-*` options (see `SPECS` for their help)."""

    target: str | None = None  # model directory; None = the bundled tiny target
    drafter: str | None = None  # pkg.mod:factory or a model directory; None = the bundled drafters
    bundled: str = DEFAULT_BUNDLED  # which bundled set, without --losscheck-drafter (`losscheck.plan.bundled_sets`)
    engine: str | None = None  # a shipped adapter's name or pkg.mod:factory of a black-box engine (losscheck.engines)
    assistant: str | None = None  # --engine hf: the assistant model directory
    speculative_config: str | None = None  # --engine vllm: its speculative config, JSON
    engine_args: tuple[str, ...] = ()  # KEY=VALUE arguments of a shipped adapter's engine
    allow_lossy_mode: bool = False  # run a mode lossy by design (losscheck.engines.lossy); its verdict FAILs
    scope: Scope = field(default_factory=Scope)  # the part of the matrix certified (losscheck.plan.scope)
    shard: Shard | None = None  # this run's share of the cells in scope (losscheck.plan.shard); None = all
    require_pass: bool = False  # pytest exits non-zero unless the verdict is PASS
    verifier: str | None = None  # pkg.mod:factory() -> Verifier deciding every white-box cell's blocks
    seed: int = DEFAULT_SEED
    out: Path | None = None  # write the certificate under this directory
    alpha: float = DEFAULT_ALPHA  # family-wise false-alarm rate of the whole run
    profile: Profile = field(default_factory=lambda: PROFILES[DEFAULT_PROFILE])
    trust_remote_code: bool = False
    mutant: str | None = None  # run the gate against a planted bug (losscheck.selftest)
    memory_budget_mib: int = DEFAULT_MEMORY_BUDGET_MIB  # sizes engine batches and teacher-forced chunks
    device: str | None = None  # cpu / cuda / mps; None = cuda when present, else cpu
    precisions: tuple[Precision, ...] = parse_precisions(DEFAULT_PRECISIONS)  # first = the base cell's
    proxy_precision: str = "auto"  # two-sample engine cells' proxy: auto = fp32 where it fits the device
    strict: bool = False  # fail greedy near-ties in reduced precision too
    exact: bool = True  # exact-mode cells on the bundled small target (off: main-target cells only)
    prompts: str | None = None  # JSONL prompt file; None = the bundled prompt sets
    chat_template: bool = False  # wrap text prompts in the tokenizer's chat template
    perf_profile: str = DEFAULT_PERF_PROFILE  # sizes of the perf tier (losscheck.plan.perf_profiles)
    perf_compare: str | None = None  # a saved perf.json to compare the perf tier's run with
    perf_compare_fail: str = DEFAULT_COMPARE_FAIL  # METRIC:N%,... drops that fail the compare
    perf_concurrency: str | None = None  # an engine perf run's ladder, "1,4,16"; None = the profile's
    perf_arrivals: str = "closed"  # an engine perf run's arrival processes (losscheck.plan.arrivals)
    perf_k: str | None = None  # an engine perf run's k sweep, "2,4,6"; None = the engine's own k
    sampling: tuple[str, ...] = ()  # served-parameter SPECs, one extra sampled cell each (plan.sampling_spec)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise OptionError(f"{flag('alpha')} must be in (0, 1), got {self.alpha}")
        if self.memory_budget_mib < 1:
            raise OptionError(f"{flag('memory-budget')} must be >= 1 MiB, got {self.memory_budget_mib}")
        if not 0 < self.profile.detect_tv < 1:
            raise OptionError(f"{flag('detect-tv')} must be in (0, 1), got {self.profile.detect_tv}")


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _usage_errors(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse `type`: its `OptionError` becomes an `ArgumentTypeError`, which
    argparse and pytest show as a usage error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _sampling_spec(text: str) -> object:
    from losscheck.plan.sampling_spec import parse_sampling  # torch: only when the option is given

    return parse_sampling(text)


def _registered_plant(name: str) -> str:
    from losscheck.run.plant import get_plant  # the registered plants load only when the option is given

    get_plant(name)
    return name


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse `type` that checks the text with `parse` (its `OptionError` a usage error) and
    keeps the text, so the option passes on to pytest as it was given."""

    def check(text: str) -> str:
        parse(text)
        return text

    return _usage_errors(check)


def _engine_arg(text: str) -> str:
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


class _Help(TypedDict):
    help: str


class OptionSpec(_Help, total=False):
    """The keyword arguments of pytest's `addoption` / argparse's `add_argument` an option uses."""

    metavar: str
    choices: Sequence[str]
    default: object
    type: Callable[[str], object]
    action: str


# name -> how it is declared
SPECS: dict[str, OptionSpec] = {
    "target": {
        "metavar": "PATH",
        "help": "local Hugging Face model directory of the target (default: the bundled tiny target)",
    },
    "drafter": {
        "metavar": "MOD:FACTORY|DIR",
        "help": "import path of a factory(target) -> Drafter, or a local Hugging Face "
        "causal-LM directory, certified as a family-A drafter named after it "
        "(default: the bundled drafters)",
    },
    "bundled": {
        "choices": BUNDLED,
        "default": DEFAULT_BUNDLED,
        "help": "without --losscheck-drafter, certify the bundled reference set (the reference drafter, family A, "
        "and the truncation widths of family E, the axis A lacks), all the bundled drafters (the parallel "
        "families B-E and the speculators checkpoints, whole), or the cells of all that the reference set leaves "
        "out (others: with the main job, every bundled cell once) (default: %(default)s; `losscheck certify`: "
        "reference)",
    },
    "engine": {
        "metavar": "NAME|MOD:FACTORY",
        "help": "a black-box engine, certified against itself with drafting off (one-sample PIT when it "
        "declares a precision, else two-sample): a shipped adapter by name (hf, vllm, vllm+cpu-fixes, vllm-serve, "
        "openvino, llamacpp, openai, sglang; docs/black-box-engines.md) or the import path of a "
        "factory(target) -> engine. Without a drafter option the run certifies the engine's cells only",
    },
    "assistant": {
        "metavar": "DIR",
        "help": "with --losscheck-engine=hf: the assistant model directory (Hugging Face assisted generation)",
    },
    "speculative-config": {
        "metavar": "JSON",
        "help": "with --losscheck-engine=vllm: vLLM's speculative config, as `vllm serve` takes it, e.g. "
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'',
    },
    "engine-arg": {
        "metavar": "KEY=VALUE",
        "type": _engine_arg,
        "action": "append",
        "help": "an option of a shipped adapter, VALUE as JSON where it parses (vllm: a keyword of vllm.LLM, e.g. "
        "max_model_len=512, or losscheck_instances=one-at-a-time; hf and openvino: num_assistant_tokens=N; "
        "llamacpp: n_draft=N, n_threads=N, target_weights=q8_0); repeat for more",
    },
    "allow-lossy-mode": {
        "action": "store_true",
        "help": "run a configuration that sets a mode lossy by design (vLLM's synthetic or FLy rejection "
        "sampling, transformers' assistant_ensemble_weight, a speculators checkpoint's top-k acceptance; "
        "docs/black-box-engines.md), which is otherwise refused before any cell runs; its verdict is FAIL, "
        "naming the mode as lossy by design",
    },
    "sampling": {
        "metavar": "SPEC",
        "type": _checked(_sampling_spec),
        "action": "append",
        "help": "sampling parameters of an extra sampled cell, NAME=VALUE pairs separated by spaces "
        "(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, "
        "logit_bias=ID:BIAS,..., banned_ids=ID,..., min_tokens, stop_ids=ID,..., grammar=regex:PATTERN or "
        "json:SCHEMA), e.g. "
        "\"repetition_penalty=1.2 min_p=0.05\"; one cell per use on the drafter's base cell (and the engine's)",
    },
    "scope": {
        "metavar": "TERMS",
        "type": _usage_errors(parse_scope),
        "default": None,
        "help": "the part of the matrix to certify: comma-separated kinds to keep (greedy, pit, exact, "
        "engine-greedy, one-sample, two-sample, sampling, engine) and -ASPECTs to leave out (split, prefix, "
        "batching, precision, stress, width, edge, oracle, slow), e.g. -split on one GPU, and +EXTRAs to add "
        "(+served: an engine's cells of the penalties, min-p, logit bias, banned ids and min tokens); the "
        "verdict is PASS of that scope (default: the whole matrix)",
    },
    "shard": {
        "metavar": "I/N",
        "type": _usage_errors(parse_shard),
        "default": None,
        "help": "certify shard I of N: a deterministic share of the cells in scope, balanced by estimated cost, "
        "on one of N CI runners; each shard's certificate is PARTIAL, and `losscheck merge` joins the N run "
        "directories into one certificate of the whole scope (default: every cell)",
    },
    "require-pass": {
        "action": "store_true",
        "help": "exit non-zero unless the certificate's verdict is PASS (plain pytest exits 0 on a PARTIAL "
        "run; `losscheck certify` always requires it)",
    },
    "verifier": {
        "metavar": "MOD:FACTORY",
        "help": "import path of a factory() -> Verifier (losscheck.core.verify) that decides every drafted block "
        "of losscheck's own loop in the white-box cells, instead of losscheck's verifier and any drafter's own "
        "(a planted bug's verifier still wins in the mutant tier); e.g. losscheck.verifiers.hf:speculative_sampling",
    },
    "seed": {
        "metavar": "N",
        "type": int,
        "default": DEFAULT_SEED,
        "help": "run seed; every random draw derives from it (default: %(default)s)",
    },
    "out": {"metavar": "DIR", "help": "write DIR/<run>/certificate.json and summary.md"},
    "alpha": {
        "metavar": "A",
        "type": _probability,
        "default": DEFAULT_ALPHA,
        "help": "family-wise false-alarm rate of the run (default: %(default)s)",
    },
    "detect-tv": {
        "metavar": "TV",
        "type": _probability,
        "default": None,
        "help": "total variation every sampled cell must detect (default: the profile's, 0.02 for ci)",
    },
    "profile": {
        "choices": sorted(PROFILES),
        "default": DEFAULT_PROFILE,
        "help": "named sample-size profile (default: %(default)s)",
    },
    "trust-remote-code": {"action": "store_true", "help": "let the target load custom modelling code"},
    "mutant": {
        "metavar": "NAME",
        "type": _usage_errors(_registered_plant),
        "help": "run the gate against a planted bug (see `losscheck mutants`)",
    },
    "device": {
        "choices": DEVICES,
        "default": None,
        "help": "device of the target and drafters (default: cuda when present, else cpu)",
    },
    "precision": {
        "metavar": "LIST",
        "type": _usage_errors(parse_precisions),
        "default": parse_precisions(DEFAULT_PRECISIONS),
        "help": "comma-separated precisions TARGET[/DRAFTER] from fp32, bf16, fp16; the first is the base "
        f"cell's, each other one a cell of its own (default: {DEFAULT_PRECISIONS})",
    },
    "proxy-precision": {
        "choices": ("auto", "fp32", "bf16", "fp16"),
        "default": "auto",
        "help": "the precision of the proxy that sizes and scores a black-box engine's two-sample cells "
        "(default auto: fp32, unless the accelerator's memory plan fits fp32 nowhere, then the target's own dtype)",
    },
    "exact": {
        "choices": ("on", "off"),
        "default": "on",
        "help": "exact-mode cells on the bundled 8-token target (default: on); off certifies with main-target "
        "cells only, as a user's own target is",
    },
    "strict": {
        "action": "store_true",
        "help": "fail greedy divergences in reduced precision even where the target's "
        "float64 top-2 margin is within that precision's round-off (near-ties)",
    },
    "prompts": {
        "metavar": "FILE",
        "help": 'JSONL prompts, one {"text": ...} or {"ids": [...]} per line, optional "tier" '
        "(low/mid/high; else placed by the target's next-token entropy); text goes "
        "through the target's tokenizer (default: the bundled prompt sets)",
    },
    "chat-template": {
        "action": "store_true",
        "help": "wrap each text prompt as a user turn with the tokenizer's chat template",
    },
    "memory-budget": {
        "metavar": "MIB",
        "type": int,
        "default": DEFAULT_MEMORY_BUDGET_MIB,
        "help": "memory budget per process, in MiB: rows are decoded and teacher-forced in chunks "
        "whose [rows, positions, vocabulary] tensors fit (default: %(default)s)",
    },
    "perf-profile": {
        "choices": sorted(PERF_PROFILES),
        "default": DEFAULT_PERF_PROFILE,
        "help": "sizes of the perf tier: quick (CPU, bundled models, minutes) or full (a GPU runner) "
        "(default: %(default)s)",
    },
    "perf-compare": {
        "metavar": "RUN",
        "help": "a perf.json of an earlier perf run (with --losscheck-engine, of an earlier run of an engine): "
        "fail where a rung's speedup or tau fell by more than --losscheck-perf-compare-fail",
    },
    "perf-compare-fail": {
        "metavar": "EXPR",
        "type": _checked(parse_thresholds),
        "default": DEFAULT_COMPARE_FAIL,
        "help": "drops that fail the compare, METRIC:N%%,... with METRIC speedup or tau (default: %(default)s)",
    },
    "perf-concurrency": {
        "metavar": "LIST",
        "type": _checked(parse_concurrency),
        "help": "with --losscheck-engine: the concurrency ladder, e.g. 1,4,16 (default: the perf profile's)",
    },
    "perf-arrivals": {
        "metavar": "LIST",
        "type": _checked(parse_arrivals),
        "default": "closed",
        "help": "with --losscheck-engine: how requests arrive, any of closed, poisson:RATE (requests/s), "
        "gamma:RATE@BURSTINESS (vllm bench serve's --request-rate and --burstiness), burst:SIZE@SECONDS, "
        "comma-separated; each is timed over the ladder (default: %(default)s)",
    },
    "perf-k": {
        "metavar": "LIST",
        "type": _checked(parse_block_lengths),
        "help": "with --losscheck-engine: a k sweep, the block lengths timed at the lowest concurrency, "
        "e.g. 2,4,6 (default: the engine's own k only)",
    },
}


def dest(name: str) -> str:
    return "losscheck_" + name.replace("-", "_")


def add_options(add: Callable[..., Any], prefix: str, names: Iterable[str] = tuple(SPECS)) -> None:
    """Declare the options `names` with `add` (pytest's `addoption` or argparse's `add_argument`);
    their help names the other options with the same `prefix`."""
    for name in names:
        spec = SPECS[name]
        add(prefix + name, dest=dest(name), **{**spec, "help": spec["help"].replace("--losscheck-", prefix)})


def from_parsed(get: Callable[[str], Any]) -> Options:
    """`Options` from parsed values, `get(dest)`; options not declared keep their defaults."""

    def value(name: str, default: Any = None) -> Any:
        try:
            return get(dest(name))
        except (AttributeError, ValueError):  # argparse namespace / pytest config without it
            return default

    out = value("out")
    return Options(
        target=value("target"),
        drafter=value("drafter"),
        bundled=value("bundled", DEFAULT_BUNDLED),
        engine=value("engine"),
        assistant=value("assistant"),
        speculative_config=value("speculative-config"),
        engine_args=tuple(value("engine-arg") or ()),
        allow_lossy_mode=bool(value("allow-lossy-mode", False)),
        scope=value("scope") or Scope(),
        shard=value("shard"),
        require_pass=bool(value("require-pass", False)),
        verifier=value("verifier"),
        seed=value("seed", DEFAULT_SEED),
        out=Path(out) if out else None,
        alpha=value("alpha", DEFAULT_ALPHA),
        profile=get_profile(value("profile", DEFAULT_PROFILE)).with_detect_tv(value("detect-tv")),
        trust_remote_code=bool(value("trust-remote-code", False)),
        mutant=value("mutant"),
        memory_budget_mib=value("memory-budget", DEFAULT_MEMORY_BUDGET_MIB),
        device=value("device"),
        precisions=value("precision", None) or parse_precisions(DEFAULT_PRECISIONS),
        proxy_precision=value("proxy-precision", "auto"),
        strict=bool(value("strict", False)),
        exact=value("exact", "on") != "off",
        prompts=value("prompts"),
        chat_template=bool(value("chat-template", False)),
        perf_profile=value("perf-profile", DEFAULT_PERF_PROFILE),
        perf_compare=value("perf-compare"),
        perf_compare_fail=value("perf-compare-fail", DEFAULT_COMPARE_FAIL),
        perf_concurrency=value("perf-concurrency"),
        perf_arrivals=value("perf-arrivals", "closed"),
        perf_k=value("perf-k"),
        sampling=tuple(value("sampling") or ()),
    )


def pytest_args(options_given: dict[str, Any]) -> list[str]:
    """The `--losscheck-*` command-line arguments that pass `options_given` (name -> value) on."""
    args = []
    for name, val in options_given.items():
        if val is None or val is False:
            continue
        if isinstance(val, Scope):
            if val.whole:
                continue
            val = val.text
        if isinstance(val, list):  # a repeated option
            args += [f"--losscheck-{name}={v}" for v in val]
            continue
        if isinstance(val, tuple):  # parsed precisions: back to their command-line form
            val = ",".join(p.label() for p in val)
        args.append(f"--losscheck-{name}" if val is True else f"--losscheck-{name}={val}")
    return args
