"""`losscheck selftest gpu`: the GPU runner's path, run end to end on a real-shaped model before a
user's release is certified there (docs/gpu.md).

Terms:
- *shape*: the models' sizes (`SHAPES`): `real` is a Llama-3.2-1B-shaped decoder with Llama 3's
  128,256-token vocabulary (1.2B parameters); `tiny` the same code at a size a CPU runs in a minute
  or two (a 4,096-token vocabulary), for the suite's own tests;
- *pair*: the target, built from its config with random weights (no hub access), and a matching
  drafter: the target's first `DRAFT_LAYERS` layers with its embeddings, final norm and head (an
  early-exit self-drafter, as LayerSkip trains one), so that its acceptance is far from zero
  without training;
- *step*: one `losscheck` command on the pair (`steps`), run in a process of its own, so that each
  starts with an empty accelerator and a crash is one step's FAIL: losscheck's loop, Hugging Face
  assisted generation as a black-box engine and vLLM (where it is installed) with the drafter as
  its draft model, each certifying its greedy and its T = 1 cell at k = `K` (`CELLS`), and the perf
  tier at a short ladder.

A certifying step passes when its certificate counts every selected cell passed and none failed
or errored (its verdict is PARTIAL by design: the rest of the matrix is not run); the perf step
when its command exits 0. The suite passes when every step that ran passed. On a machine
without a CUDA device nothing is built: the suite says so and exits 0 (`--device cpu` runs it
there anyway, at the tiny shape in the tests).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 128_256  # Llama 3's vocabulary: the real size of every per-token tensor of the loop
DRAFT_LAYERS = 2
K = 4  # the drafter's block length in every step


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes (the target's; the drafter keeps `DRAFT_LAYERS` of its layers)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    logit_scale: float  # the head's weights times this: a peaked next-token law, as a trained model's

    def config(self, layers: int) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 0,
        }


SHAPES = {
    "real": Shape(VOCAB, 2048, 8192, 16, 32, 8, 64, 8.0),
    "tiny": Shape(4096, 128, 256, 4, 4, 2, 32, 8.0),  # head_dim 32: the smallest vLLM's CPU attention takes
}


@dataclass(frozen=True)
class Pair:
    target: Path
    drafter: Path
    parameters: int  # the target's
    seconds: float  # to build and save both


def build_pair(out: Path, shape: Shape, seed: int) -> Pair:
    """The target (random weights from `seed`) and its early-exit drafter, saved under `out` as
    Hugging Face directories in fp32 (each step loads them in the precision it tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(**shape.config(shape.layers))).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(shape.logit_scale)
    drafter = LlamaForCausalLM(LlamaConfig(**shape.config(DRAFT_LAYERS))).eval()
    kept = {name: tensor for name, tensor in target.state_dict().items() if _kept_by_drafter(name)}
    missing = drafter.load_state_dict(kept, strict=False).missing_keys
    if missing:  # every drafter weight is one of the target's
        raise RuntimeError(f"the drafter's weights not found in the target's: {missing}")
    paths = out / "target", out / "drafter"
    for model, path in zip((target, drafter), paths, strict=True):
        model.save_pretrained(path)
    parameters = sum(p.numel() for p in target.parameters())
    return Pair(paths[0], paths[1], parameters, time.perf_counter() - started)


def _kept_by_drafter(name: str) -> bool:
    if not name.startswith("model.layers."):
        return True
    return int(name.split(".")[2]) < DRAFT_LAYERS


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after `losscheck`
    needs: str | None = None  # a module the step needs installed (else NOT RUN)
    certifies: bool = False  # judged by its certificate's counts (`--out`), not its exit status


LOOP_SCOPE = "greedy,pit"
ENGINE_SCOPE = "engine-greedy,one-sample"
CELLS = 2  # each certifying step's: greedy and T = 1 at k = K


def cells(drafter: str) -> tuple[str, ...]:
    """pytest's `-k` for the greedy and the T = 1 cell of `drafter` (`user` for a --drafter, `engine`)."""
    return ("--", "-k", f"{drafter}-k{K}-greedy] or {drafter}-k{K}-T1]")


def steps(pair: Pair, device: str, precision: str, out: Path, seed: int) -> list[Step]:
    """The suite's commands on `pair`: the loop, HF assisted generation, vLLM, the perf tier."""
    common = ("--target", str(pair.target), "--device", device, "--seed", str(seed), "--precision", precision)
    speculative = json.dumps({"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": K})
    # vLLM's CPU build samples wrongly as shipped (docs/vllm.md); its fixed sampler is losscheck's
    vllm = "vllm" if device == "cuda" else "vllm+cpu-fixes"
    return [
        Step(
            "loop",
            ("certify", *common, "--drafter", str(pair.drafter), "--scope", LOOP_SCOPE, "--out", str(out / "loop"))
            + ("-n", "0", *cells("user")),
            certifies=True,
        ),
        Step(
            "hf-engine",
            ("certify", *common, "--engine", "hf", "--assistant", str(pair.drafter), "--scope", ENGINE_SCOPE)
            + ("--out", str(out / "hf-engine"), "-n", "0", *cells("engine")),
            certifies=True,
        ),
        Step(
            "vllm-engine",
            ("certify", *common, "--engine", vllm, "--speculative-config", speculative, "--scope", ENGINE_SCOPE)
            + ("--engine-arg", "losscheck_instances=one-at-a-time", "--engine-arg", "skip_tokenizer_init=true")
            + ("--out", str(out / "vllm-engine"), "-n", "0")
            + cells("engine"),
            needs="vllm",
            certifies=True,
        ),
        Step(
            "perf",
            ("perf", *common, "--drafter", str(pair.drafter), "--perf-profile", "quick", "--perf-k", str(K))
            + ("--perf-concurrency", "1,4", "--out", str(out / "perf")),
        ),
    ]


@dataclass(frozen=True)
class Outcome:
    step: str
    verdict: str  # PASS, FAIL, NOT RUN
    seconds: float
    detail: str  # the exit status, or why the step did not run

    def line(self) -> str:
        return f"  {self.step:<12} {self.verdict:<8} {self.seconds:7.1f} s  {self.detail}"


def run_step(step: Step, log: Path) -> Outcome:
    """`losscheck ARGV` in a process of its own, its output to `log` (and the console)."""
    if step.needs is not None and importlib.util.find_spec(step.needs) is None:
        return Outcome(step.name, "NOT RUN", 0.0, f"{step.needs} is not installed here")
    started = time.perf_counter()
    with log.open("w", encoding="utf-8") as sink:
        sink.write("losscheck " + " ".join(step.argv) + "\n")
        sink.flush()
        command = [sys.executable, "-m", "losscheck.cli", *step.argv]
        status = subprocess.call(command, stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    detail = f"exit {status} (docs/errors.md); log {log}"
    if not step.certifies:
        return Outcome(step.name, "PASS" if status == 0 else "FAIL", seconds, detail)
    counts = certificate_counts(Path(step.argv[step.argv.index("--out") + 1]))
    passed = counts.get("passed") == CELLS and not counts.get("failed") and not counts.get("errored")
    return Outcome(step.name, "PASS" if passed else "FAIL", seconds, f"cells {counts}; {detail}")


def certificate_counts(out: Path) -> dict[str, int]:
    """The cell counts of the one certificate a step wrote under `out` (none written: empty)."""
    found = sorted(out.glob("*/certificate.json"))
    if not found:
        return {}
    return dict(json.loads(found[-1].read_text(encoding="utf-8"))["counts"])


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_line(device: str) -> str:
    import torch

    if device != "cuda":
        return f"device: {device}"
    props = torch.cuda.get_device_properties(0)
    count = torch.cuda.device_count()
    return f"device: {count} x {props.name}, {props.total_memory / 1024**3:.0f} GiB each; torch {torch.__version__}"


def run_suite(out: Path, shape_name: str, device: str, precision: str, seed: int, only: Sequence[str] = ()) -> bool:
    """Build the pair under `out`, run every step (those named in `only`, when given) and print
    one line per step; True when no step that ran failed."""
    shape = SHAPES[shape_name]
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device), flush=True)
    pair = build_pair(out / "models", shape, seed)
    print(
        f"pair: {shape_name} Llama shape, vocabulary {shape.vocab:,}, target {pair.parameters / 1e6:,.1f}M parameters "
        f"({shape.layers} layers), drafter its first {DRAFT_LAYERS} layers; built in {pair.seconds:.1f} s",
        flush=True,
    )
    outcomes = []
    for step in steps(pair, device, precision, out, seed):
        if only and step.name not in only:
            continue
        outcome = run_step(step, out / f"{step.name}.log")
        print(outcome.line(), flush=True)
        outcomes.append(outcome)
    failed = [o.step for o in outcomes if o.verdict == "FAIL"]
    ran = sum(o.verdict != "NOT RUN" for o in outcomes)
    print(f"selftest gpu: {ran - len(failed)}/{ran} steps passed" + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    return not failed
