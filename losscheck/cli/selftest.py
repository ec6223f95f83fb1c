"""`losscheck selftest gpu`: the GPU runner's path on a real-shaped model, before a release is
certified there (`losscheck.selftest.gpu`, docs/gpu.md). Exit status 0 when every step that ran
passed, or when there is no GPU to run on (nothing is run, and it says so); 1 when a step failed."""

from __future__ import annotations

import argparse
from pathlib import Path

from losscheck.cli.command import EXIT_FAIL, EXIT_PASS, Command
from losscheck.run.options import add_options, dest

SUITES = ("gpu",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from losscheck.selftest.gpu import SHAPES

    parser.add_argument("suite", choices=SUITES, help="gpu: losscheck's loop, HF, vLLM and perf on one GPU")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="real",
        help="real: a Llama-3.2-1B-shaped pair with a 128k vocabulary; tiny: the same code at CPU size "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu runs the suite without a GPU (with --shape tiny: its own tests) (default: %(default)s)",
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="the precision every step loads the pair in (default: %(default)s, as a GPU serves)",
    )
    parser.add_argument("--step", action="append", default=[], help="run only this step (loop, hf-engine, ...)")
    add_options(parser.add_argument, "--", ("seed",))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("reports/selftest-gpu"),
        help="the pair, logs and reports (default: %(default)s)",
    )


def run(ns: argparse.Namespace) -> int:
    from losscheck.selftest.gpu import has_cuda, run_suite

    if ns.device == "cuda" and not has_cuda():
        print("losscheck selftest gpu needs a CUDA GPU (torch.cuda.is_available() is False here): nothing run")
        return EXIT_PASS
    passed = run_suite(ns.out, ns.shape, ns.device, ns.precision, getattr(ns, dest("seed")), ns.step)
    return EXIT_PASS if passed else EXIT_FAIL


COMMAND = Command(
    "selftest",
    "gpu: losscheck's loop, HF assisted generation, vLLM and the perf tier on a real-shaped model on one GPU "
    "(docs/gpu.md); exits 0 without a GPU, saying nothing ran",
    add_arguments,
    run,
)
