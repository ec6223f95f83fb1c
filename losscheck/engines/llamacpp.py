"""llama.cpp behind the black-box interface, through its Python binding (`llama-cpp-python`):
`llama_cpp.Llama(target.gguf, draft_model=DRAFTER)` (speculation on) and the same target's `Llama`
without a draft model (off, the baseline).

The binding's speculative loop (`Llama.generate`) is *sample and match*: after each target step it
asks the draft model (a `llama_cpp.llama_speculative.LlamaDraftModel`: `__call__(input_ids) ->
draft ids`) for a block, evaluates the last token and the block in one batch, then samples the
target at each position with the request's own sampler chain and keeps going while the sampled
token equals the draft; at the first mismatch it drops the rest and the KV cache behind it. The
target's sampler thus draws every emitted token from the target's own distribution, one draw per
token whether drafting is on or off: a proposal decides only which positions are computed ahead,
so a drafter cannot bias the output; what could are the loop's bookkeeping (which logits row is
sampled, the KV rollback) and batched logits that differ from one-at-a-time ones. Drafter A is
driven as a `LlamaDraftModel` (`GreedyDrafter`): its own `Llama` over the drafter's GGUF proposes
its k most likely tokens in turn.

Each continuation is its own `generate` call with its own sampler seed (`set_seed`), derived from
the call's seed, the prompt and the row, the same on both sides; the sampler chain gets
temperature, top-k, top-p and every other stage at its neutral value (min-p 0 where the binding
defaults to 0.05, top-k 0 = off where it defaults to 40, no penalties, typical-p and tfs 1, no
mirostat). Both models run from F32 GGUF with an F32 KV cache (llama.cpp's default is F16): the
engine's precision is "fp32", and losscheck scores its samples with its own fp32 copy of the target.
A quantized target (`target_weights=q8_0`, the `quantization` axis: llama.cpp's own quantizer over
the F32 GGUF, as `llama-quantize` does) has no reference losscheck can load: its cells are
two-sample, its speculative samples against its own plain side. A `.gguf` target given as it is
counts as F32 only when its header says so (`general.file_type`).

llama.cpp runs GGUF: `gguf_file` converts a Hugging Face Llama directory once with
`fixtures/build_gguf.py` into a cache keyed by the directory's files, `$LOSSCHECK_LLAMACPP_CACHE`
or `~/.cache/losscheck/llamacpp`; a `.gguf` path is used as it is. `python -m
losscheck.engines.llamacpp export DIR...` fills the cache ahead of a run (`tox -e llamacpp` does).
The GGUF has no vocabulary (`no_vocab`), so llama.cpp knows no EOS: the adapter stops a row at
the target's EOS itself.

A failure is never retried: an exception from llama.cpp becomes a `LlamaCppEngineError` naming the
engine, the side, the prompt, the row and its seed, and the `Llama` is dropped (its KV cache is in
an unknown state). `llama_cpp` is imported on first use only (docs/llamacpp.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.engines import row_by_row
from losscheck.engines.counters import EngineCounters
from losscheck.engines.export import model_key
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import (
    QUANTIZATION,
    EngineSpec,
    arg_axis,
    needs_assistant,
    option,
    register,
)
from losscheck.engines.served import GRAMMAR_UNSUPPORTED
from losscheck.errors import LosscheckError, OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

SEEDS = 0xFFFFFFFF  # llama.cpp seeds are uint32, and 0xFFFFFFFF (LLAMA_DEFAULT_SEED) means "random"
N_CTX = 256  # the bundled fixtures' positions
GGML_TYPE_F32 = 0  # llama_cpp.GGML_TYPE_F32, without importing llama_cpp
# the target's weight types: llama.cpp's file type (`llama_ftype`, `general.file_type` in a GGUF) of each
WEIGHTS = {"f32": 0, "q8_0": 7}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0


class LlamaCppEngineError(LosscheckError):
    """llama.cpp failed on a request: an engine failure, not a verdict."""


# --- GGUF: the converted model files ------------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("LOSSCHECK_LLAMACPP_CACHE") or Path.home() / ".cache" / "losscheck" / "llamacpp")


def gguf_writer() -> Any:
    """`fixtures/build_gguf.py` (installed with the package as losscheck/fixtures/build_gguf.py),
    loaded from its file: the fixtures directory is data, not an importable package in a checkout."""
    from losscheck import bundled

    path = bundled.fixtures_dir() / "build_gguf.py"
    spec = importlib.util.spec_from_file_location("losscheck_build_gguf", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise OptionError(f"the GGUF writer {path} is missing; set LOSSCHECK_FIXTURES to a checkout's fixtures/")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gguf_file(model: str | Path) -> Path:
    """GGUF of `model`: the file itself when it is one, else the cached conversion of the Hugging Face
    Llama directory."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if not (path / "config.json").is_file():
        raise OptionError(f"{path} is neither a Hugging Face model directory (config.json) nor a .gguf file")
    out = cache_root() / f"{model_key(path)}.gguf"
    if not out.is_file():
        try:
            gguf_writer().convert(path, out)
        except (ImportError, ValueError) as exc:
            raise OptionError(f"converting {path} to GGUF failed: {exc} (the gguf package must be installed)") from exc
    return out


def quantized(source: Path, weights: str) -> Path:
    """`source` (an F32 GGUF) with its weights quantized to `weights` by llama.cpp's own quantizer
    (`llama_model_quantize`, what `llama-quantize` runs), cached beside the conversions under a key
    of the source's path, size and modification time."""
    if weights == "f32":
        return source
    if file_type(source) != WEIGHTS["f32"]:
        raise OptionError(f"{source} is not an F32 GGUF; quantize from the F32 conversion (its Hugging Face directory)")
    stat = source.stat()
    stamp = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    out = cache_root() / f"{source.stem}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}-{weights}.gguf"
    if out.is_file():
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = WEIGHTS[weights]
    params.nthread = 1
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.{os.getpid()}")  # renamed into place: no reader sees half a file
    if llama_cpp.llama_model_quantize(str(source).encode(), str(work).encode(), ctypes.byref(params)) != 0:
        work.unlink(missing_ok=True)
        raise OptionError(f"llama.cpp could not quantize {source} to {weights} (llama_model_quantize failed)")
    work.replace(out)
    return out


def file_type(gguf: Path) -> int | None:
    """The GGUF's `general.file_type` (a `llama_ftype`; None when the header has none)."""
    try:
        import gguf as gguf_package
    except ImportError as exc:
        raise OptionError(f"reading {gguf}'s weight type needs the gguf package: pip install gguf") from exc
    reader = gguf_package.GGUFReader(str(gguf))
    found = reader.get_field("general.file_type")
    return None if found is None else int(found.contents())


# --- the drafter ------------------------------------------------------------------------------------
def greedy_drafter(draft_gguf: Path, k: int, threads: int) -> Any:
    """A `LlamaDraftModel` over the drafter's GGUF that proposes its k most likely tokens in turn.
    The class is built here, so that `llama_cpp` is imported only when a drafter is made."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDrafter(LlamaDraftModel):
        """`calls` counts proposals: each is followed by one target step (the batch it drafted);
        `drafted` the ids proposed."""

        def __init__(self) -> None:
            self.k, self.calls, self.drafted = k, 0, 0
            self.model = Llama(
                str(draft_gguf), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False,
            )  # fmt: skip

        def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
            self.calls += 1
            room = min(self.k, N_CTX - len(input_ids))
            drafts: list[int] = []
            if room > 0:  # the drafter's generate reuses its KV cache for the common prefix
                for token in self.model.generate(input_ids.tolist(), temp=0.0, top_k=0, top_p=1.0, min_p=0.0):
                    drafts.append(token)
                    if len(drafts) == room:
                        break
            self.drafted += len(drafts)
            return np.asarray(drafts, dtype=np.intc)

    return GreedyDrafter()


# --- the engine ---------------------------------------------------------------------------------------
# llama.cpp's penalties read a window of the last `last_n_tokens_size` (64) tokens its sampler has
# accepted, not vLLM's prompt and output (repetition) or output alone (presence, frequency); the
# binding has no min-tokens stage
WINDOW = (
    "llama.cpp penalises the last n tokens its sampler accepted (repeat_last_n), not the request's prompt "
    "and output as vLLM and losscheck's reference do"
)
# what the adapter passes to llama-cpp-python (`losscheck.engines.served`: the rest is refused)
LLAMACPP_SERVES = frozenset({"min_p", "logit_bias", "banned_ids"})
LLAMACPP_UNSUPPORTED = dict.fromkeys(("repetition_penalty", "presence_penalty", "frequency_penalty"), WINDOW) | {
    "min_tokens": "llama-cpp-python's generate has no min-tokens stage",
    **GRAMMAR_UNSUPPORTED,
}
MIN_P_ORDER = (
    "llama-cpp-python's chain applies min-p after top-k and top-p and before temperature, vLLM after "
    "temperature and before them; certify min-p at T = 1 alone"
)


class LogitBias:
    """A `Llama.generate` logits processor adding `bias` [V] (numpy float32; -inf bans an id) to
    every row's logits: what the binding's own `logit_bias` (`create_completion`) does, as a
    processor `generate` takes."""

    def __init__(self, pairs: tuple[tuple[int, float], ...], banned: tuple[int, ...]) -> None:
        self.pairs, self.banned = pairs, banned

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        for i, bias in self.pairs:
            scores[i] += bias
        for i in self.banned:
            scores[i] = -float("inf")
        return scores


def sampler_args(params: SamplingParams, eos: int | None = None) -> dict[str, Any]:
    """losscheck's request as `Llama.generate`'s sampler arguments: temperature (0: the greedy
    sampler), top-k (0 = off), top-p, min-p (at T = 1 without top-k or top-p only: `MIN_P_ORDER`),
    a logit bias and banned ids through a `LogitBias` processor, and every other stage of the
    binding's chain neutral, its defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8)
    overridden explicitly. The penalties and min tokens raise `UnsupportedParameter`
    (`LLAMACPP_UNSUPPORTED`)."""
    from losscheck.engines.served import UnsupportedParameter, refuse

    refuse(params, "llamacpp", LLAMACPP_SERVES, LLAMACPP_UNSUPPORTED, eos)
    if params.min_p and not params.greedy and (params.temperature != 1 or params.top_k or params.top_p < 1):
        raise UnsupportedParameter(f"engine 'llamacpp' cannot serve min_p={params.min_p!r} here: {MIN_P_ORDER}")
    bias = LogitBias(params.logit_bias, params.banned_ids) if params.logit_bias or params.banned_ids else None
    return {
        "temp": 0.0 if params.greedy else float(params.temperature),
        "top_k": int(params.top_k),
        "top_p": float(params.top_p),
        "min_p": float(params.min_p),
        "typical_p": 1.0,
        "tfs_z": 1.0,
        "repeat_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "mirostat_mode": 0,
        "logits_processor": bias,
    }


class LlamaCppEngine:
    """`make_llama(speculative)` builds a `llama_cpp.Llama` (with the draft model or without it) and,
    when speculative, its drafter; each side is built on first use and kept until it fails."""

    serves = LLAMACPP_SERVES
    first_token = "prefill"  # the prompt's evaluation samples the first token; drafting starts after it

    def __init__(
        self,
        make_llama: Callable[[bool], tuple[Any, Any]],
        k: int,
        eos: int,
        name: str = "llama.cpp",
        precision: str | None = "fp32",
    ):
        self.k, self.eos = k, eos
        self.precision = precision  # None: quantized weights, two-sample against its own plain side
        self.name = f"{name}(k={k})"
        self.sides: Instances[bool, tuple[Any, Any]] = Instances(make_llama, Policy.KEEP_ALL)
        # spec-decode counters summed over the speculative calls (`counters`)
        self._counters = EngineCounters(drafts=0, drafted=0, emitted=0)

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        args = sampler_args(request.params, self.eos)
        speculative = request.speculative

        def row(i: int, j: int) -> list[int]:
            row_seed = request.row_seed(i, j) % SEEDS
            where = f"{'speculative' if speculative else 'plain'} side, prompt {i}, row {j}, seed {row_seed}"
            return self._row(speculative, list(request.prompts[i]), row_seed, args, request.max_new_tokens, where)

        return row_by_row(request, self.eos, row)

    def _row(self, speculative: bool, prompt: list[int], seed: int, args: dict, limit: int, where: str) -> list[int]:
        llama, drafter = self.sides.get(speculative)
        calls, drafted = (drafter.calls, drafter.drafted) if drafter is not None else (0, 0)
        new: list[int] = []
        try:
            llama.set_seed(seed)
            tokens = llama.generate(prompt, **args)
            for token in tokens:
                new.append(int(token))
                if token == self.eos or len(new) == limit:
                    break
            tokens.close()
        except Exception as exc:  # the binding raises RuntimeError, ValueError, ctypes errors: all are the engine's
            self.sides.discard(speculative)  # its KV cache and token buffer are in an unknown state
            raise LlamaCppEngineError(
                f"engine {self.name!r} failed ({where}): {type(exc).__name__}: {exc}; not retried (docs/llamacpp.md)"
            ) from exc
        if drafter is not None:
            one = EngineCounters(drafts=drafter.calls - calls, drafted=drafter.drafted - drafted, emitted=len(new) - 1)
            self._counters = self._counters.plus(one)
        return new

    def counters(self) -> EngineCounters:
        """The speculative calls' counters so far: rounds (target steps after the prefill, one per
        proposal), the ids the drafter proposed, and the tokens the rounds emitted (tau = emitted /
        rounds). The binding does not report which drafts it accepted."""
        return self._counters


def llamacpp_engine(
    target: str | Path,
    draft: str | Path,
    k: int,
    eos: int,
    name: str = "llama.cpp",
    threads: int = 1,
    weights: str = "f32",
    **llama_kwargs: Any,
) -> LlamaCppEngine:
    """A `LlamaCppEngine` over the target and draft models (Hugging Face Llama directories or GGUF
    files), drafter driven by `greedy_drafter` with `k` tokens a round; the target's weights
    quantized to `weights` (`WEIGHTS`; not F32: a two-sample engine); `threads` for every `Llama`;
    `llama_kwargs` any other `Llama` keyword, over the F32 KV cache and n_ctx 256."""
    target_gguf, draft_gguf = quantized(gguf_file(target), weights), gguf_file(draft)
    precision = "fp32" if file_type(target_gguf) == WEIGHTS["f32"] else None
    kwargs = {"n_ctx": N_CTX, "type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32, **llama_kwargs}

    def make_llama(speculative: bool) -> tuple[Any, Any]:
        from llama_cpp import Llama

        drafter = greedy_drafter(draft_gguf, k, threads) if speculative else None
        llama = Llama(
            str(target_gguf), n_threads=threads, n_threads_batch=threads, draft_model=drafter, verbose=False, **kwargs
        )
        return llama, drafter

    return LlamaCppEngine(make_llama, k, eos, name=name, precision=precision)


# --- factories: the bundled fixtures ------------------------------------------------------------------
K = 4


def bundled_drafter_a(target: Any) -> LlamaCppEngine:
    """`fixtures/target` with `fixtures/drafter_a` as a greedy `LlamaDraftModel`, k = 4, fp32, one
    thread (certify it with the default --losscheck-target)."""
    from losscheck import bundled

    eos = target.eos_id if target.eos_id is not None else 0
    fixtures = bundled.fixtures_dir()
    return llamacpp_engine(fixtures / "target", fixtures / "drafter_a", K, eos, "llama-cpp-python[drafter_a]")


# --- the shipped adapter: --engine llamacpp --assistant DIR [--engine-arg n_draft=N] [n_threads=N] -----
@dataclass(frozen=True)
class LlamaCppOptions:
    n_draft: int = option(K, minimum=1, help="the tokens the draft model proposes per round")
    n_threads: int = option(1, minimum=1, help="threads of every Llama")
    target_weights: str = option(
        "f32",
        choices=tuple(WEIGHTS),
        help="the target's GGUF weights: f32 (one-sample, scored by losscheck's fp32 target) or q8_0 "
        "(llama.cpp's quantizer; two-sample against its own plain side)",
    )


def _build(target: Target, request: EngineSpec, options: LlamaCppOptions) -> LlamaCppEngine:
    assert request.assistant is not None
    eos = target.eos_id if target.eos_id is not None else 0
    name = f"llama-cpp-python[{Path(request.assistant).name}]"
    if options.target_weights != "f32":
        name = f"{name}[{options.target_weights}]"
    return llamacpp_engine(
        request.target, request.assistant, options.n_draft, eos, name, options.n_threads, options.target_weights
    )


LLAMACPP_AXES = (
    arg_axis(
        "k", (2,), "n_draft", "n_draft 2: another block length, other batch shapes (k + 1 rows) in the target's steps"
    ),
    arg_axis(
        QUANTIZATION,
        ("q8_0",),
        "target_weights",
        "the target quantized to Q8_0 by llama.cpp's quantizer (drafter F32): two-sample, its speculative "
        "rows against its own plain rows, as no fp32 reference scores Q8_0 logits",
    ),
)


register(
    "llamacpp",
    "llama-cpp-python's Llama, --assistant DIR as draft model (docs/llamacpp.md)",
    options=LlamaCppOptions,
    inputs=needs_assistant("the draft model directory"),
    build=_build,
    package="llama_cpp",
    axes=LLAMACPP_AXES,
)


def main(argv: list[str] | None = None) -> int:
    """`python -m losscheck.engines.llamacpp export DIR...`: fill the GGUF cache, one line per model."""
    from losscheck.engines.export import export_main

    return export_main("losscheck.engines.llamacpp", gguf_file, argv)


if __name__ == "__main__":
    raise SystemExit(main())
