"""The registry of engine adapters: the engines `--losscheck-engine NAME` builds, by name.

An adapter is one module that calls `register(name, summary, options=..., inputs=..., build=...)`
at import and imports its engine library only inside `build`, so the registry (option checks,
`--list`) loads no engine. What it takes from the command line:

- *inputs*: the model options, `--assistant DIR` (`needs_assistant`) or the adapter's own check of
  `--speculative-config JSON`, checked first;
- *options*: its `--engine-arg KEY=VALUE` options as a frozen dataclass, parsed here from the
  fields' annotations — `int`, `float`, `bool`, `str`, an `Enum` (by value), each optionally
  `| None` — with what `option(default, minimum=, choices=, help=)` declares, and at most one
  `rest()` field that takes every other key (an engine's own keyword arguments). Without a `rest()`
  field an unknown key is an error. VALUE arrives parsed as JSON where it parses (`engine_args`).

Each bad value is one `OptionError` naming the option, the value and what is accepted, before any
model loads. `build(target, request, options)` gets the parsed options record.

An adapter also declares its *axes* (`EngineAxis`): the engine's own knobs that must not change what
it emits (block length, dtype, prefix caching, chunked prefill, the speculative method). Each value
of an axis is a *variant* of the engine, built by the same `build` from the request the axis
derives (`EngineAxis.vary`); the matrix gives every variant cells of its own, one change from the
engine as named (`losscheck.plan.matrix.engine_cells`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from losscheck.definitions import same_definition
from losscheck.errors import LosscheckError, OptionError

if TYPE_CHECKING:
    from losscheck.core.contract import Target
    from losscheck.engines import BlackBoxEngine

Options = TypeVar("Options")


@dataclass(frozen=True)
class EngineSpec:
    """An adapter's engine as the command line specifies it (`--target`, `--assistant`,
    `--speculative-config`, `--engine-arg`): what the adapter builds from, once per run; a
    `GenerationRequest` (`losscheck.engines.request`) is one generate call to the engine built.
    Called `EngineRequest` before 2026-12-06 (the old name imports, with a DeprecationWarning)."""

    target: str  # the target's model directory (the bundled target's when --target is not given)
    assistant: str | None = None  # --assistant DIR
    speculative_config: dict[str, Any] | None = None  # --speculative-config JSON
    args: dict[str, Any] = field(default_factory=dict)  # --engine-arg KEY=VALUE, VALUE parsed as JSON where it parses
    prefix: str = "--losscheck-"  # how the messages name the options


# the engine axis whose values are weight formats losscheck cannot load: its cells are two-sample
QUANTIZATION = "quantization"

Inputs = Callable[[EngineSpec, str], None]  # checks the model options of engine NAME; raises OptionError
AxisValue = int | str  # an engine or serving axis's value (`losscheck.serving.axis` too): 2, "bf16", "warm"


@dataclass(frozen=True)
class EngineAxis:
    """One knob of an engine that must not change what it emits.

    Three names carry the contract's meaning (`BlackBoxEngine`): `k`, whose values are block
    lengths (the variant's cells run at that k); `dtype`, whose values are precisions ("bf16"; a
    one-sample variant is scored in it); and `quantization`, whose values are weight formats
    losscheck cannot load ("q8_0"), so the variant's cells are two-sample, against the variant's own
    plain side. A value the engine as named already has is no variant.
    """

    name: str  # its key in a cell's variant and in `--losscheck-scope=-NAME`
    values: tuple[AxisValue, ...]  # one variant each, one change from the engine as named
    # the request of the engine at `value`, or None when the request already has it
    vary: Callable[[EngineSpec, AxisValue], EngineSpec | None]
    doc: str  # one line: what the variant changes and what its cells check


def with_args(request: EngineSpec, **args: Any) -> EngineSpec | None:
    """`request` with `args` over its --engine-arg options, or None when it already has them: the
    `vary` of most axes."""
    varied = {**request.args, **args}
    return None if varied == request.args else dataclasses.replace(request, args=varied)


def arg_axis(name: str, values: tuple[AxisValue, ...], key: str, doc: str) -> EngineAxis:
    """An axis whose every value sets the `--engine-arg` option `key` to it."""
    return EngineAxis(name, values, lambda request, value: with_args(request, **{key: value}), doc)


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: `check` the request before any model loads, `build` the engine from the
    loaded target."""

    name: str
    summary: str  # one line: the engine and what it takes
    options: type  # a frozen dataclass of its --engine-arg options
    inputs: Inputs
    make: Callable[[Target, EngineSpec, Any], BlackBoxEngine]
    package: str | None = None  # the engine library's import name (None: the adapter's own module)
    axes: tuple[EngineAxis, ...] = ()  # the knobs its engine certificate varies, one at a time

    def variants(self, request: EngineSpec) -> list[tuple[str, AxisValue, EngineSpec]]:
        """(axis, value, the variant's request) of every declared axis value `request` does not
        already have, each request checked as the command line's is."""
        found = []
        for axis in self.axes:
            for value in axis.values:
                varied = axis.vary(request, value)
                if varied is not None:
                    self.parse(varied)
                    found.append((axis.name, value, varied))
        return found

    def parse(self, request: EngineSpec) -> Any:
        """The options record of `request`, its model options checked first."""
        self.inputs(request, self.name)
        return parse_options(self.options, request.args, f"{request.prefix}engine={self.name}", request.prefix)

    def check(self, request: EngineSpec) -> None:
        self.parse(request)

    def build(self, target: Target, request: EngineSpec) -> BlackBoxEngine:
        return self.make(target, request, self.parse(request))

    @property
    def library(self) -> str:
        """The import name whose installed version the certificate pins."""
        return self.package or self.make.__module__


ADAPTERS: dict[str, Adapter] = {}  # in registration order


def register(
    name: str,
    summary: str,
    *,
    options: type[Options],
    inputs: Inputs,
    build: Callable[[Target, EngineSpec, Options], BlackBoxEngine],
    package: str | None = None,
    axes: tuple[EngineAxis, ...] = (),
) -> Adapter:
    """Add the adapter `name`; its options' annotations are checked here, so a field of a type the
    parser cannot read fails at import, not on a user's command line. `package` is the import name
    of the engine library it drives, whose installed version the certificate pins; `axes` the
    knobs its certificate varies (`EngineAxis`)."""
    known = ADAPTERS.get(name)
    if known is not None and not same_definition(known.make, build):  # a re-import replaces itself
        raise LosscheckError(f"an engine adapter named {name!r} is already registered; give yours another name")
    if not (dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise LosscheckError(f"engine adapter {name!r}: options={options!r} is not a frozen dataclass")
    fields = _fields(options)
    if sum(bool(f.metadata.get("rest")) for f in fields.values()) > 1:
        raise LosscheckError(f"engine adapter {name!r}: {options.__name__} has more than one rest() field")
    hints = typing.get_type_hints(options)
    for f in fields.values():
        if not f.metadata.get("rest"):
            _accepted(hints[f.name], f.metadata, f"engine adapter {name!r}: {options.__name__}.{f.name}")
    names = [a.name for a in axes]
    if len(set(names)) < len(names):
        raise LosscheckError(f"engine adapter {name!r}: axes {names} repeat a name")
    adapter = Adapter(name, summary, options, inputs, build, package, axes)
    ADAPTERS[name] = adapter
    return adapter


def option(default: Any, *, minimum: float | None = None, choices: tuple[Any, ...] = (), help: str = "") -> Any:
    """A field of an options record: its default, and what else a value must meet."""
    return field(default=default, metadata={"minimum": minimum, "choices": choices, "help": help})


def rest(help: str = "") -> Any:
    """The field of an options record that takes every key the others do not, as a dict."""
    return field(default_factory=dict, metadata={"rest": True, "help": help})


def parse_options(options: type[Options], args: Mapping[str, Any], engine: str, prefix: str) -> Options:
    """`args` (`--engine-arg` KEY → value) as an `options` record; `engine` names the engine in the
    messages (`--losscheck-engine=hf`), `prefix` the options."""
    fields, hints = _fields(options), typing.get_type_hints(options)
    rest_name = next((f.name for f in fields.values() if f.metadata.get("rest")), None)
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in args.items():
        f = fields.get(key)
        if f is not None and not f.metadata.get("rest"):
            values[key] = _value(key, value, hints[key], f.metadata, prefix)
        elif rest_name is not None:
            extra[key] = value
        else:
            named = list(fields)
            described = "; ".join(
                f"{n}: {_accepted(hints[n], fields[n].metadata, n)}, default {_shown(fields[n].default)}" for n in named
            )
            takes = f"takes {', '.join(named)} only ({described})" if named else "takes no --engine-arg"
            raise OptionError(f"{prefix}engine-arg {key}={value!r}: {engine} {takes}")
    if rest_name is not None:
        values[rest_name] = extra
    return options(**values)


def _fields(options: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(options)}


def _shown(default: Any) -> str:
    return repr(default.value if isinstance(default, enum.Enum) else default)


def _optional(hint: Any) -> tuple[Any, bool]:
    """(`T`, True) for `T | None`, else (`hint`, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _accepted(hint: Any, metadata: Mapping[str, Any], where: str) -> str:
    """What a value of a field annotated `hint` must be, in words ("an int >= 1")."""
    kind, _ = _optional(hint)
    minimum, choices = metadata.get("minimum"), metadata.get("choices", ())
    if choices:
        return f"one of {list(choices)}"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return f"one of {[m.value for m in kind]}"
    words = {bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(kind)
    if words is None:
        raise LosscheckError(f"{where}: {hint!r} is no option type (int, float, bool, str, an Enum, or one | None)")
    return words if minimum is None else f"{words} >= {minimum}"


def _value(key: str, value: Any, hint: Any, metadata: Mapping[str, Any], prefix: str) -> Any:
    kind, optional = _optional(hint)
    if value is None and optional:
        return None
    parsed = _typed(value, kind)
    minimum, choices = metadata.get("minimum"), metadata.get("choices", ())
    if parsed is None or (minimum is not None and parsed < minimum) or (choices and parsed not in choices):
        help = metadata.get("help")
        explained = f" ({help})" if help else ""
        raise OptionError(f"{prefix}engine-arg {key}={value!r}: need {_accepted(hint, metadata, key)}{explained}")
    return parsed


def _typed(value: Any, kind: Any) -> Any:
    """`value` as a `kind`, or None when it is not one (a bool is no number)."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next((m for m in kind if m.value == value), None)
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is int:
        return value if isinstance(value, int) else None
    if kind is float:
        return float(value) if isinstance(value, (int, float)) else None
    return value if kind is str and isinstance(value, str) else None


def needs_assistant(what: str) -> Inputs:
    """The model options of an engine that drafts with a model directory: `--assistant DIR` (`what`
    it is, in the message when it is missing), and no vLLM speculative config."""

    def check(request: EngineSpec, engine: str) -> None:
        opt = request.prefix
        if request.assistant is None:
            raise OptionError(f"{opt}engine={engine} needs {opt}assistant=DIR: {what}")
        if request.speculative_config is not None:
            raise OptionError(f"{opt}speculative-config is vLLM's; {opt}engine={engine} takes {opt}assistant")

    return check


def engine_args(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as keyword arguments: VALUE as JSON where it parses (512, true, {"a": 1}),
    else the string."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            args[key.strip()] = json.loads(text)
        except ValueError:
            args[key.strip()] = text
    return args


def speculative_config(text: str | None, option: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise OptionError(f'{option}={text!r} is not JSON ({exc}); e.g. \'{{"method": "ngram", ...}}\'') from None
    if not isinstance(config, dict):
        raise OptionError(f"{option}={text!r} is a JSON {type(config).__name__}; pass a JSON object")
    return config


def __getattr__(name: str) -> type[EngineSpec]:
    if name == "EngineRequest":  # the old name (CHANGELOG.md, Deprecated)
        import warnings

        warnings.warn(
            "losscheck.engines.registry.EngineRequest is deprecated: it is EngineSpec (what the command "
            "line specifies about an engine); the old name goes after 0.1.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return EngineSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
