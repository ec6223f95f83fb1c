"""llama.cpp through its Python binding, certified end to end: `tox -e llamacpp` (docs/llamacpp.md).

1. The GGUF writer (`fixtures/build_gguf.py`): llama.cpp's logits of the converted fixtures agree
   with Hugging Face's, and the check fails for a conversion that skips the q / k permutation.
2. The adapter (`losscheck.engines.llamacpp`): the request maps onto the binding's sampler chain and
   nothing else, greedy speculation drafts and equals plain decoding, a failure is raised by name.
3. The black-box cells through the shipped certification tests, in a pytest subprocess: the greedy
   cell and the five one-sample cells of the bundled target with drafter A as a `LlamaDraftModel`,
   through `--losscheck-engine=llamacpp`.

Everything skips where llama_cpp cannot be imported (the main `tox -e tests` environment).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: tox -e llamacpp builds and installs it (docs/llamacpp.md)"
)
pytest.importorskip("gguf", reason="the gguf package (the GGUF writer's) is not installed: tox -e llamacpp has it")

from losscheck import bundled
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.llamacpp import (
    GGML_TYPE_F32,
    LlamaCppEngineError,
    gguf_file,
    gguf_writer,
    llamacpp_engine,
    sampler_args,
)
from tests import support
from tests.support import engine_request

pytestmark = pytest.mark.llamacpp
pytest_plugins = ["pytester"]

EOS = 1  # the bundled target's
LOGIT_TOLERANCE = 1e-3  # llama.cpp's F32 kernels against torch's, fp32 logits of magnitude ~10


def all_prompts() -> list[list[int]]:
    return [p for tier in ("low", "mid", "high") for p in bundled.load_prompts(tier)]


def engine(k: int = 4):
    fixtures = bundled.fixtures_dir()
    return llamacpp_engine(bundled.target_path(), fixtures / "drafter_a", k, EOS)


def max_logit_error(model_dir, gguf) -> float:
    """Largest |llama.cpp - Hugging Face| logit over every position of every bundled prompt, each
    followed by the target's greedy continuation (so that positions past the prompts are covered)."""
    from llama_cpp import Llama

    from losscheck.core.target import load_causal_lm

    hf = load_causal_lm(model_dir, "fp32")
    llama = Llama(str(gguf), n_ctx=256, logits_all=True, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    worst = 0.0
    for prompt in all_prompts():
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None)[0]
            expected = hf(ids[None]).logits[0]  # [T, V]
        llama.reset()
        llama.eval(ids.tolist())
        got = torch.from_numpy(llama.scores[: len(ids)].copy())  # [T, V]
        worst = max(worst, float((got - expected).abs().max()))
    return worst


# --- 1. the GGUF writer -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["target", "drafter_a"])
def test_converted_logits_match_hugging_face(name):
    model_dir = bundled.fixtures_dir() / name
    error = max_logit_error(model_dir, gguf_file(model_dir))
    assert error < LOGIT_TOLERANCE, f"{name}: llama.cpp's logits differ from Hugging Face's by up to {error:.3g}"


def test_the_logit_check_fails_without_the_rope_permutation(tmp_path, monkeypatch):
    """The same conversion with q and k left in Hugging Face's rotate-half layout: llama.cpp loads it,
    and its logits are far off, so the check above can fail."""
    writer = gguf_writer()
    monkeypatch.setattr(writer, "permute", lambda weight, n_head: weight)
    model_dir = bundled.target_path()
    error = max_logit_error(model_dir, writer.convert(model_dir, tmp_path / "unpermuted.gguf"))
    assert error > 100 * LOGIT_TOLERANCE, f"without the permutation the logits differ by only {error:.3g}"


def test_gguf_is_converted_once_and_a_gguf_file_is_used_as_it_is(tmp_path):
    from losscheck.errors import OptionError

    converted = gguf_file(bundled.target_path())
    assert converted.suffix == ".gguf" and gguf_file(bundled.target_path()) == converted
    assert gguf_file(converted) == converted
    with pytest.raises(OptionError, match="neither a Hugging Face model directory"):
        gguf_file(tmp_path)


# --- 2. the adapter -----------------------------------------------------------------------------------
def test_sampler_args_are_exactly_the_request():
    args = sampler_args(SamplingParams(temperature=0.3, top_k=8, top_p=0.9))
    assert (args["temp"], args["top_k"], args["top_p"]) == (0.3, 8, 0.9)
    neutral = {"min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "repeat_penalty": 1.0}
    assert {key: args[key] for key in neutral} == neutral and args["mirostat_mode"] == 0
    assert args["frequency_penalty"] == args["presence_penalty"] == 0.0
    assert sampler_args(SamplingParams())["top_k"] == 0  # off, where the binding's default is 40
    assert sampler_args(GREEDY)["temp"] == 0.0  # the binding's greedy sampler


def test_greedy_speculation_drafts_and_equals_plain_decoding():
    """On the bundled prompts at 64 tokens: speculation on == off token for token, and the drafter
    was asked for a block more than once per four tokens (tau > 1.5, tokens per target step)."""
    llama, prompts = engine(), all_prompts()
    on = llama.generate(engine_request(prompts, 1, GREEDY, 0, 64, True))
    off = llama.generate(engine_request(prompts, 1, GREEDY, 0, 64, False))
    assert torch.equal(on, off)
    counts = llama.counters()
    assert counts.drafts > 0 and counts.drafted > 0 and counts.tau > 1.5, counts


def test_rows_are_reproducible_from_the_seed_and_differ_across_seeds():
    llama, prompts, params = engine(), all_prompts()[:6], SamplingParams()
    first = llama.generate(engine_request(prompts, 3, params, 11, 16, True))
    assert torch.equal(first, llama.generate(engine_request(prompts, 3, params, 11, 16, True)))
    assert not torch.equal(first, llama.generate(engine_request(prompts, 3, params, 12, 16, True)))
    assert not torch.equal(first[:, 0], first[:, 1])  # rows of one call are independent draws


def test_an_engine_failure_is_raised_by_name_and_not_retried():
    """An id outside the vocabulary makes llama_decode fail: the error names the engine, the side, the
    prompt, the row and its seed; the next call builds a fresh Llama and answers."""
    llama = engine()
    with pytest.raises(LlamaCppEngineError, match=r"speculative side, prompt 1, row 0, seed \d+"):
        llama.generate(engine_request([[0, 2, 5], [0, 64]], 1, SamplingParams(), 0, 8, True))
    assert llama.generate(engine_request([[0, 2, 5]], 1, SamplingParams(), 0, 8, True)).shape == (1, 1, 8)


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
def test_drafting_on_and_off_give_the_same_tokens_seed_for_seed(weights):
    """The binding's loop draws once per emitted token from the request's seeded sampler whether or
    not it drafts, so with the same seed the two sides agree token for token wherever their logits
    agree: an exact check of the sampled path, stronger than the statistical cells. A difference
    is either a batched step rounding differently from a one-token step (fp32 here: none seen) or a
    bug in the loop's bookkeeping; either way it is shown, not averaged away. Q8_0 weights too: their
    batched verification steps (k + 1 rows) round as the one-token steps do (none differed)."""
    fixtures, prompts = bundled.fixtures_dir(), all_prompts()
    llama = llamacpp_engine(bundled.target_path(), fixtures / "drafter_a", 4, EOS, weights=weights)
    for params in (SamplingParams(), SamplingParams(temperature=1.5), SamplingParams(top_p=0.9)):
        on = llama.generate(engine_request(prompts, 5, params, 3, 16, True))
        off = llama.generate(engine_request(prompts, 5, params, 3, 16, False))
        rows = (on != off).any(-1).nonzero().tolist()  # [prompt, row] pairs that differ
        assert not rows, f"{params}: {len(rows)} of {len(prompts) * 5} rows differ seed for seed, first {rows[:3]}"


def test_top_k_keeps_another_set_of_tied_tokens_than_torch():
    """After the lone [BOS] prompt the bundled target's 64 logits are all exactly 0 (in Hugging Face and
    in llama.cpp alike), so any 8 tokens are a top 8: llama.cpp keeps a set other than torch.topk's,
    with speculation on and off: those positions are cut-off ambiguous (docs/llamacpp.md)."""
    from losscheck.core.target import load_causal_lm

    with torch.no_grad():
        logits = load_causal_lm(bundled.target_path(), "fp32")(torch.tensor([[0]])).logits[0, 0]  # [V]
    assert bool((logits == logits[0]).all()), "the logits after [BOS] are no longer tied: the finding is gone"
    kept = set(logits.topk(8).indices.tolist())
    for speculative in (True, False):
        drawn = set(
            engine().generate(engine_request([[0]], 200, SamplingParams(top_k=8), 0, 1, speculative)).flatten().tolist()
        )
        assert len(drawn) == 8 and drawn != kept, (speculative, sorted(drawn), sorted(kept))


def test_a_q8_0_target_is_quantized_by_llamacpp_and_certified_two_sample():
    """`target_weights="q8_0"`: llama.cpp's quantizer writes a Q8_0 GGUF (file type 7, a quarter of the
    F32 bytes), the engine claims no precision losscheck can load (two-sample), its greedy
    speculation equals its own plain decoding, and its greedy rows are not the F32 target's on
    every prompt: a one-sample reference would be the wrong one."""
    from losscheck.engines.llamacpp import WEIGHTS, file_type, quantized

    f32 = gguf_file(bundled.target_path())
    q8 = quantized(f32, "q8_0")
    assert file_type(q8) == WEIGHTS["q8_0"] and q8.stat().st_size < f32.stat().st_size / 3
    fixtures, prompts = bundled.fixtures_dir(), all_prompts()
    engine_q8 = llamacpp_engine(bundled.target_path(), fixtures / "drafter_a", 4, EOS, weights="q8_0")
    assert engine_q8.precision is None and engine().precision == "fp32"
    on = engine_q8.generate(engine_request(prompts, 1, GREEDY, 0, 64, True))
    off = engine_q8.generate(engine_request(prompts, 1, GREEDY, 0, 64, False))
    assert torch.equal(on, off)
    plain_f32 = engine().generate(engine_request(prompts, 1, GREEDY, 0, 64, False))
    assert (plain_f32 != off).any(-1).sum() > 0


# --- 3. the black-box cells -------------------------------------------------------------------------
def test_the_black_box_cells_certify_the_binding(pytester):
    """`--losscheck-engine=llamacpp --losscheck-assistant=fixtures/drafter_a`: the greedy cell and the
    five one-sample cells (T 1, 0.3, 1.5, top-k 8, top-p 0.9), at the gate's α (speculation-off rows
    only after a first-stage rejection). Every cell passes: top-k 8's positions after
    the tied [BOS] prompt (the test above) are cut-off ambiguous and left out of its tests, whatever
    token was drawn there (`losscheck.cells.scoring.cutoff_ambiguous`; before, only positions whose
    drawn token losscheck cut were, and the cell failed on the rest)."""
    result = support.certify_engine(
        pytester,
        "llamacpp",
        "test_engine_greedy or test_engine_sampling",
        f"--losscheck-assistant={bundled.fixtures_dir() / 'drafter_a'}",
        "--losscheck-scope=-engine-axes",
        "-rA",
    )
    result.assert_outcomes(passed=6)
    output = result.stdout.str()
    assert "LlamaCppEngineError" not in output and "UnderpoweredError" not in output


def test_the_binding_is_certified_over_its_axes_with_a_q8_0_target(pytester):
    """The adapter's axes, each a greedy and a T = 1 cell: n_draft 2, and the target quantized to
    Q8_0 by llama.cpp's quantizer — two-sample, its speculative rows against its own plain rows,
    sized by the target-side bug classes through losscheck's fp32 target as a proxy. All pass."""
    result = support.certify_engine(
        pytester,
        "llamacpp",
        "(test_engine_greedy or test_engine_sampling) and (k2 or quantization)",
        f"--losscheck-assistant={bundled.fixtures_dir() / 'drafter_a'}",
        "-rA",
    )
    result.assert_outcomes(passed=4)
    output = result.stdout.str()
    for cell in (
        "engine-k2-greedy",
        "engine-k2-T1",
        "greedy-two-sample-quantization-q8_0",
        "T1-two-sample-quantization-q8_0",
    ):
        assert cell in output, cell
