"""What the options name — user code by import path (`pkg.mod:factory`), model directories, the
output directory — resolved and checked before a run starts.

`check_options` reads files and imports the named modules but loads no model, so a bad option is
one message at start-up instead of an error inside test collection after the models have loaded.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.engines.lossy import Found
    from losscheck.engines.named import EngineSpec
    from losscheck.run.options import Options

MODEL_DIR = "a local Hugging Face model directory (config.json and *.safetensors weights)"


def _raised_at(exc: BaseException) -> str:
    """`file:line` of the innermost frame that raised `exc` (the user's code, not losscheck's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_object(spec: str, option: str, expected: str = "an import path like 'pkg.module:factory'") -> Any:
    """Resolve `pkg.mod:attr` (or `pkg.mod.attr`); raise OptionError naming `option` on failure.

    Modules resolve from the current directory too (`pytest`, unlike `python -m pytest`, leaves
    it off sys.path)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr or module_name.startswith("."):
        raise OptionError(f"{option}={spec!r}: expected {expected}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise OptionError(
                f"{option}={spec!r}: importing module {module_name!r} failed: {exc}{_raised_at(exc)}"
            ) from exc
        raise OptionError(
            f"{option}={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
            f"(install it, or run from the directory that contains it: {cwd!r} is searched)"
        ) from exc
    except Exception as exc:  # the user's module raised while importing
        raise OptionError(
            f"{option}={spec!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}{_raised_at(exc)}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise OptionError(f"{option}={spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def load_factory(spec: str, option: str, returns: str, **expected: str) -> Any:
    """`load_object`, checked to be callable; `returns` says what it must build."""
    factory = load_object(spec, option, **expected)
    if not callable(factory):
        raise OptionError(f"{option}={spec!r} is a {type(factory).__name__}, not a factory(target) -> {returns}")
    return factory


def is_model_dir(spec: str) -> bool:
    """Whether a `--losscheck-drafter` value names a directory rather than an import path."""
    return Path(spec).expanduser().is_dir()


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith(("~", "."))


def model_config(
    path: str | Path, option: str, own_code_fix: str | None = None, weights: bool = True
) -> dict[str, Any]:
    """config.json of the model directory `path`, after checking that it loads offline: the
    directory, its config and its safetensors weights exist, and transformers implements its
    model type as a causal LM. A model that needs its own code (`auto_map`) is accepted when
    `own_code_fix` is None (remote code allowed); otherwise the error tells `own_code_fix`.
    `weights=False`: a directory with config.json alone will do (a plan for other hardware)."""
    where = f"{option}={str(path)!r}"
    path = Path(path).expanduser()
    if not path.is_dir():
        hint = ""
        if not path.is_absolute() and str(path).count("/") == 1 and not path.parent.exists():
            hint = (
                f"; losscheck loads local directories only, offline: download a hub model first "
                f"(hf download {path} --local-dir DIR)"
            )
        raise OptionError(f"{where}: no such directory; pass {MODEL_DIR}{hint}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise OptionError(f"{where} has no config.json; pass {MODEL_DIR}")
    if weights and not any(path.glob("*.safetensors")):
        raise OptionError(
            f"{where} has no *.safetensors weights; losscheck loads safetensors only "
            "(convert with model.save_pretrained(dir, safe_serialization=True))"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise OptionError(f"{where}: cannot read config.json ({exc})") from exc
    _check_model_type(config, where, own_code_fix)
    return config


def _check_model_type(config: dict[str, Any], where: str, own_code_fix: str | None) -> None:
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    own_code = "AutoModelForCausalLM" in config.get("auto_map", {})
    if model_type in CONFIG_MAPPING_NAMES:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not own_code:
            raise OptionError(f"{where} is a {model_type!r} model, which transformers does not load as a causal LM")
        return
    if own_code_fix is None:
        return  # its own code is allowed; transformers says so if there is none
    unknown = f"{where}: transformers {transformers_version} does not implement model_type {model_type!r}"
    if own_code:
        raise OptionError(
            f"{unknown}; the directory ships its own modelling code (config.json auto_map): {own_code_fix}"
        )
    raise OptionError(f"{unknown}, and config.json has no auto_map (code of its own): upgrade transformers")


def _shape(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(vocabulary size, hidden size) from a config.json, also a nested text_config's."""
    inner = config.get("text_config") or {}
    return (config.get("vocab_size") or inner.get("vocab_size"), config.get("hidden_size") or inner.get("hidden_size"))


def check_out_dir(out: Path, option: str) -> None:
    """The certificate can be written under `out`: it is a directory, or can be made one."""
    existing = out.expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OptionError(f"{option}={str(out)!r}: {str(existing)!r} is a file; name a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".losscheck-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OptionError(
            f"{option}={str(out)!r}: cannot write in {str(existing)!r} ({exc.strerror}); name a writable directory"
        ) from exc


def check_options(options: Options, prefix: str = "--losscheck-", weights: bool = True) -> None:
    """Check what `options` name, without loading a model; raise OptionError naming the option
    (as `prefix` + name: `--losscheck-` for pytest, `--` for `losscheck certify`) and the fix.
    `weights=False`: model directories need their config.json only (`model_config`)."""
    from losscheck import bundled
    from losscheck.drafters import dflash_config, speculators_config

    def opt(name: str) -> str:
        return prefix + name

    def bundled_shape() -> tuple[int | None, int | None]:
        return _shape(json.loads((bundled.target_path() / "config.json").read_text()))

    trust_fix = None if options.trust_remote_code else f"pass {opt('trust-remote-code')} to run it, if you trust it"
    if options.target is not None:
        target_shape = _shape(model_config(options.target, opt("target"), trust_fix, weights))
        target_name = f"{opt('target')}={options.target!r}"
    drafter = options.drafter
    if speculators_config.is_spec(drafter):
        assert drafter is not None
        if options.target is None:
            target_config, target_name = (
                json.loads((bundled.target_path() / "config.json").read_text()),
                "the bundled target",
            )
        else:
            target_config = json.loads((Path(options.target).expanduser() / "config.json").read_text())
        try:
            checkpoint = speculators_config.read_config(speculators_config.spec_path(drafter))
            speculators_config.check_against(checkpoint, speculators_config.target_shape(target_config, target_name))
        except OptionError as exc:
            raise OptionError(f"{opt('drafter')}={drafter!r}: {exc}") from exc
    elif dflash_config.is_dflash_dir(drafter):
        from types import SimpleNamespace

        assert drafter is not None
        where = f"{opt('drafter')}={drafter!r}"
        target_config = json.loads(
            (
                (bundled.target_path() if options.target is None else Path(options.target).expanduser()) / "config.json"
            ).read_text()
        )
        vocab, hidden = _shape(target_config)
        depth = int(target_config.get("num_hidden_layers") or 0)
        try:
            declared = SimpleNamespace(**dflash_config.read(drafter, weights))
            dflash_config.check_config(declared, drafter, hidden or 0, vocab or 0, depth)
        except OptionError as exc:
            raise OptionError(f"{where}: {exc}") from exc
    elif drafter is not None and (is_model_dir(drafter) or _looks_like_path(drafter)):
        fix = f"a drafter directory loads with transformers' own classes; wrap it in {opt('drafter')}=pkg.mod:factory"
        vocab = _shape(model_config(drafter, opt("drafter"), fix, weights))[0]
        if options.target is None:
            target_shape, target_name = bundled_shape(), "the bundled target"
        if None not in (vocab, target_shape[0]) and vocab != target_shape[0]:
            raise OptionError(
                f"{opt('drafter')}={drafter!r} has a vocabulary of {vocab} tokens, {target_name} "
                f"{target_shape[0]}; a drafter must share the target's vocabulary"
            )
    elif drafter is not None:
        load_factory(
            drafter, opt("drafter"), "Drafter", expected=f"an import path like 'pkg.module:factory' or {MODEL_DIR}"
        )
    elif (
        options.engine is None
        and options.target is not None
        and None not in target_shape
        and target_shape != bundled_shape()
    ):
        vocab, hidden = bundled_shape()
        raise OptionError(
            f"{target_name} has a vocabulary of {target_shape[0]} tokens and hidden size "
            f"{target_shape[1]}; the bundled drafters are built for the bundled target's {vocab} and "
            f"{hidden}. Name your drafter: {opt('drafter')}=pkg.mod:factory, or {opt('drafter')}=DIR "
            "for a Hugging Face causal-LM drafter directory"
        )
    if not options.scope.whole:  # its aspects include the serving axes: a registry, known once it loads
        from losscheck.engines.named import ADAPTERS
        from losscheck.plan.scope import serving_axis_names

        adapter = ADAPTERS.get(options.engine) if options.engine is not None else None
        options.scope.check(serving_axis_names(), [a.name for a in adapter.axes] if adapter is not None else ())
    if options.engine is not None:
        check_engine_options(options, prefix, weights)
    found = lossy_configuration(options, prefix)
    if found and not options.allow_lossy_mode:
        from losscheck.engines.lossy import refusal

        raise OptionError(refusal(found, prefix))
    if options.out is not None:
        check_out_dir(options.out, opt("out"))
    if options.target is None:
        target_config = json.loads((bundled.target_path() / "config.json").read_text())
    else:
        target_config = json.loads((Path(options.target).expanduser() / "config.json").read_text())
    check_prompt_file(options, target_config, prefix)
    vocab = _shape(target_config)[0]
    if options.sampling:
        from losscheck.plan.sampling_spec import parse_sampling  # imports torch
    tokenizer = str(Path(options.target).expanduser().resolve()) if options.target else None  # as the session
    for spec in options.sampling:  # ids in the vocabulary (the values were checked when parsed)
        if vocab is not None:
            try:
                params = parse_sampling(spec, tokenizer)
                params.check_vocab(vocab, "the target" if options.target is None else options.target)
            except OptionError as exc:
                raise OptionError(f"{opt('sampling')}={spec!r}: {exc}") from None


def check_prompt_file(options: Options, target_config: dict[str, Any], prefix: str) -> None:
    """The prompts fit the target (`target_config`, its config.json): the `--prompts` file parses,
    its text tokenises with the target's tokenizer (no weights load), and every prompt's ids lie
    in the vocabulary and leave the positions its cells generate; without a file, the bundled
    prompts' ids lie in the vocabulary."""
    from losscheck import bundled
    from losscheck.run import prompts

    vocab = _shape(target_config)[0]
    inner = target_config.get("text_config") or {}
    max_positions = target_config.get("max_position_embeddings") or inner.get("max_position_embeddings")
    if options.prompts is None:
        if options.target is None or vocab is None:
            return
        largest = max(t for tier in prompts.TIERS for p in bundled.load_prompts(tier) for t in p)
        if largest >= vocab:
            raise OptionError(
                f"the bundled prompts are token ids of the bundled target, outside the vocabulary of {vocab} "
                f"tokens of {prefix}target={options.target!r}; pass {prefix}prompts=FILE "
                '(JSONL, one {"text": ...} or {"ids": [...]} per line)'
            )
        return
    lines = prompts.read_lines(options.prompts, prefix)
    ids = prompts.tokenize([r for _, r in lines], options.target, options.chat_template, prefix)
    room = prompts.new_tokens(options.profile)
    prompts.check_prompts(options.prompts, [n for n, _ in lines], ids, vocab, max_positions, room, prefix)


def engine_models(options: Options) -> tuple[str, str | None, int]:
    """The run's engine's model directories and split, as the options name them: its target, its
    draft model (a speculative config's `model` or `--assistant`; None without one) and its
    tensor-parallel size."""
    from pathlib import Path

    from losscheck import bundled

    target = str(Path(options.target or bundled.target_path()).expanduser())
    request = engine_request(options) if options.engine is not None else None
    draft = (request.speculative_config or {}).get("model") if request is not None else None
    draft = draft or options.assistant
    tp = int((request.args if request is not None else {}).get("tensor_parallel_size", 1))
    return target, str(Path(str(draft)).expanduser()) if draft else None, tp


def engine_request(options: Options, prefix: str = "--losscheck-") -> EngineSpec:
    """What the options give a shipped engine adapter (`losscheck.engines.named`)."""
    from losscheck import bundled
    from losscheck.engines.named import EngineSpec, engine_args, speculative_config

    return EngineSpec(
        target=str(Path(options.target).expanduser()) if options.target is not None else str(bundled.target_path()),
        assistant=options.assistant,
        speculative_config=speculative_config(options.speculative_config, f"{prefix}speculative-config"),
        args=engine_args(options.engine_args),
        prefix=prefix,
    )


def check_engine_options(options: Options, prefix: str = "--losscheck-", weights: bool = True) -> None:
    """A shipped adapter's options (and the model directories they name), or an engine factory
    that imports; the adapter options without an adapter are refused."""
    from losscheck.engines.named import ADAPTERS

    assert options.engine is not None
    adapter = ADAPTERS.get(options.engine)
    if adapter is None:
        given = [
            name
            for name, v in (
                ("assistant", options.assistant),
                ("speculative-config", options.speculative_config),
                ("engine-arg", options.engine_args),
            )
            if v
        ]
        if given:
            raise OptionError(
                f"{prefix}{given[0]} is an option of the shipped engine adapters ({', '.join(ADAPTERS)}), "
                f"not of {prefix}engine={options.engine!r}; a factory takes its own settings"
            )
        if ":" not in options.engine and "." not in options.engine:
            raise OptionError(
                f"{prefix}engine={options.engine!r}: no shipped adapter of that name ({', '.join(ADAPTERS)}) "
                "and not an import path like 'pkg.module:factory'"
            )
        load_factory(options.engine, prefix + "engine", "black-box engine")
        return
    adapter.check(engine_request(options, prefix))
    from losscheck.drafters import dflash_config

    if options.assistant is not None and options.engine == "hf" and dflash_config.is_dflash_dir(options.assistant):
        try:
            dflash_config.read(options.assistant, weights)  # the adapter checks it against the target
        except OptionError as exc:
            raise OptionError(f"{prefix}assistant={options.assistant!r}: {exc}") from exc
    elif options.assistant is not None:
        model_config(options.assistant, prefix + "assistant", weights=weights)


def lossy_configuration(options: Options, prefix: str = "--losscheck-") -> list[Found]:
    """The modes lossy by design (`losscheck.engines.lossy`) the options set: in a shipped adapter's
    `--engine-arg` and `--speculative-config`, or in the acceptance rule a speculators drafter's
    config.json declares. Reads files, loads no model."""
    import dataclasses

    from losscheck.drafters import speculators_config
    from losscheck.engines import lossy

    checkpoint: dict[str, Any] = {}
    if options.drafter is not None and speculators_config.is_spec(options.drafter):
        proposal = speculators_config.read_config(speculators_config.spec_path(options.drafter)).proposal
        checkpoint = dataclasses.asdict(proposal)
    request = None
    if options.engine is not None:
        from losscheck.engines.named import ADAPTERS

        request = engine_request(options, prefix) if options.engine in ADAPTERS else None
    if request is None and not checkpoint:
        return []
    config = lossy.Configuration(
        engine=options.engine,
        engine_args=request.args if request is not None else {},
        speculative_config=(request.speculative_config or {}) if request is not None else {},
        checkpoint=checkpoint,
        prefix=prefix,
    )
    return lossy.configured(config)
