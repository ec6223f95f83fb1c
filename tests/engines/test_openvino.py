"""OpenVINO GenAI, certified end to end: `tox -e openvino` (docs/openvino.md).

1. The adapter (`losscheck.engines.openvino`): the request maps onto `GenerationConfig` and nothing
   else, IR is exported once and reused, greedy speculation drafts and equals plain decoding.
2. The black-box cells through the shipped certification tests, in a pytest subprocess per engine:
   the greedy cell of the bundled target with drafter A, with drafter A at head_dim 32, and of the
   text fixtures.
3. Findings, asserted so that a fixed OpenVINO GenAI shows up here: speculative *sampling* fails in
   `sequence_group.cpp` (a strict xfail), after which the pipeline keeps answering without drafting;
   the adapter reports both as engine failures, and the certificate of an engine-only run names it.

Everything skips where openvino_genai cannot be imported (the main `tox -e tests` environment).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip(
    "openvino_genai", reason="OpenVINO GenAI is not installed: tox -e openvino installs it (docs/openvino.md)"
)

from losscheck import bundled
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.openvino import (
    F32,
    IR_FILE,
    OpenVINOEngine,
    OpenVINOEngineError,
    generation_config,
    ir_dir,
    openvino_engine,
)
from tests import support
from tests.support import engine_request

pytestmark = pytest.mark.openvino
pytest_plugins = ["pytester"]

THREADS = {"INFERENCE_NUM_THREADS": 1}
EOS = 1  # the bundled target's


def all_prompts() -> list[list[int]]:
    return [p for tier in ("low", "mid", "high") for p in bundled.load_prompts(tier)]


def engine(drafter: str = "drafter_a", prefix_caching: bool | None = None) -> OpenVINOEngine:
    fixtures = bundled.fixtures_dir()
    return openvino_engine(bundled.target_path(), fixtures / drafter, 4, EOS, prefix_caching=prefix_caching, **THREADS)


def raw_pipeline(speculative: bool = True, prefix_caching: bool | None = None):
    """`LLMPipeline` of the bundled target (with drafter A); `prefix_caching` None: its own scheduler."""
    import openvino_genai

    props = {**F32, **THREADS}
    draft = ir_dir(bundled.fixtures_dir() / "drafter_a")
    extra = {"draft_model": openvino_genai.draft_model(str(draft), "CPU", **props)} if speculative else {}
    if prefix_caching is not None:
        extra["scheduler_config"] = openvino_genai.SchedulerConfig()
        extra["scheduler_config"].enable_prefix_caching = prefix_caching
    return openvino_genai.LLMPipeline(str(ir_dir(bundled.target_path())), "CPU", **extra, **props)


def ids(prompt: list[int]):
    import numpy as np
    import openvino

    return openvino.Tensor(np.asarray([prompt], dtype=np.int64))


# --- 1. the adapter -----------------------------------------------------------------------------------
def test_generation_config_is_exactly_the_request():
    config = generation_config(SamplingParams(temperature=0.3, top_k=8, top_p=0.9), 17, 16, EOS, 4)
    assert config.do_sample and (config.top_k, config.rng_seed) == (8, 17)
    assert (config.temperature, config.top_p) == pytest.approx((0.3, 0.9))  # float32 in OpenVINO
    assert config.num_assistant_tokens == 4 and config.assistant_confidence_threshold == 0.0
    assert (config.repetition_penalty, config.presence_penalty, config.frequency_penalty, config.min_p) == (1, 0, 0, 0)
    assert config.eos_token_id == EOS and config.stop_token_ids == {EOS} and not config.ignore_eos
    assert config.max_new_tokens == 16 and config.min_new_tokens == 0 and config.num_return_sequences == 1
    off = generation_config(SamplingParams(), 17, 16, EOS, None)
    assert off.num_assistant_tokens is None and off.top_k > 2**32  # top-k off: OpenVINO's default
    assert not generation_config(GREEDY, 17, 16, EOS, 4).do_sample


def test_the_served_parameters_it_has_reach_the_generation_config():
    """Repetition penalty (prompt and output, as vLLM's), min-p at T = 1, min new tokens (EOS
    masked); what it lacks is refused (tests/unit/blackbox/test_served_parameters.py)."""
    params = SamplingParams(repetition_penalty=1.5, min_p=0.1, min_tokens=8)
    config = generation_config(params, 17, 16, EOS, 4)
    assert (config.repetition_penalty, config.min_p) == pytest.approx((1.5, 0.1)) and config.min_new_tokens == 8
    assert (config.presence_penalty, config.frequency_penalty) == (0, 0) and config.stop_token_ids == {EOS}


def test_ir_is_exported_once_and_an_ir_directory_is_used_as_it_is():
    exported = ir_dir(bundled.target_path())
    assert (exported / IR_FILE).is_file()
    assert ir_dir(bundled.target_path()) == exported and ir_dir(exported) == exported


def test_a_directory_without_a_model_is_refused(tmp_path):
    from losscheck.errors import OptionError

    with pytest.raises(OptionError, match="neither a Hugging Face model directory"):
        ir_dir(tmp_path)


def test_greedy_speculation_drafts_and_equals_plain_decoding():
    """On the bundled prompts at 64 tokens: speculation on == off token for token, and the engine's
    own counters say it drafted (tau > 1): the greedy cell certifies speculative decoding."""
    ov = engine()
    prompts = all_prompts()
    on = ov.generate(engine_request(prompts, 1, GREEDY, 0, 64, True))
    off = ov.generate(engine_request(prompts, 1, GREEDY, 0, 64, False))
    assert torch.equal(on, off)
    counts = ov.counters()
    assert counts.drafts > 0 and counts.drafted > 0 and counts.tau > 1.5, counts


def test_greedy_rows_end_at_a_stop_id_inside_a_block_as_plain_decoding_does():
    """Stop ids reach `stop_token_ids`: under greedy decoding at 32 tokens, with the id plain
    decoding emits most often as the stop id, speculation on equals off token for token, the rows
    that met it end there (kept, EOS after it), and many of them end early."""
    from losscheck.engines import checked_samples, lengths

    ov = engine()
    prompts = all_prompts()
    plain = ov.generate(engine_request(prompts, 1, GREEDY, 0, 32, False)).flatten(0, 1)
    stop = int(torch.mode(plain[plain != EOS]).values)
    params = SamplingParams(temperature=0, stop_ids=(stop,))
    on, off = (engine_request(prompts, 1, params, 0, 32, side) for side in (True, False))
    drawn = [checked_samples(ov, ov.generate(r), r, 64, EOS) for r in (on, off)]  # nothing after a stop
    assert torch.equal(drawn[0], drawn[1])
    ends = lengths(drawn[0].flatten(0, 1), EOS, (stop,))
    assert int((ends < 32).sum()) >= len(prompts) // 4, (stop, ends.tolist())


# --- 2. the black-box cells -------------------------------------------------------------------------
def certify_engine(pytester: pytest.Pytester, factory: str, select: str, *args: str) -> pytest.RunResult:
    """The shipped black-box tests selected by `select` for `losscheck.engines.openvino:<factory>`, in
    a pytest process of its own."""
    return support.certify_engine(pytester, f"losscheck.engines.openvino:{factory}", select, *args, "-rA")


@pytest.mark.parametrize(
    ("factory", "target"),
    [("bundled_drafter_a", None), ("bundled_drafter_a32", None), ("text_drafter_a", "text_target")],
)
def test_greedy_cell_certified(pytester, factory, target):
    """Speculation on == off, token for token, on every prompt of every tier (64 tokens), each
    divergence triaged by losscheck's fp32 copy of the target."""
    extra = [f"--losscheck-target={bundled.fixtures_dir() / target}"] if target else []
    certify_engine(pytester, factory, "test_engine_greedy", *extra).assert_outcomes(passed=1)


def test_an_int8_target_greedy_cell_certified_by_name(pytester):
    """`--losscheck-engine=openvino`'s `quantization` axis: the target exported with int8 weights
    (NNCF), certified two-sample against its own plain side: its greedy cell passes, speculation on
    == off on every prompt. (Its T = 1 cell meets the sampling failures below, as every cell of the
    engine does.)"""
    result = support.certify_engine(
        pytester,
        "openvino",
        "test_engine_greedy and quantization",
        f"--losscheck-assistant={bundled.fixtures_dir() / 'drafter_a'}",
        "-rA",
    )
    result.assert_outcomes(passed=1)
    assert "engine-k4-greedy-two-sample-quantization-int8" in result.stdout.str()


def test_speculative_sampling_fails_its_sampled_cell(pytester):
    """With prefix caching off every request returns, and the T = 1 one-sample cell FAILS by its
    statistical tests (the speculative samples are more surprising than the target's distribution),
    blamed on speculation by its second stage (fresh rows of the same engine with speculation off
    differ from fresh speculative rows): the finding that OpenVINO GenAI's speculative sampling is
    lossy, asserted so that a fixed build shows up here."""
    result = certify_engine(
        pytester, "bundled_drafter_a_no_prefix_caching", "test_engine_greedy or (test_engine_sampling and T1])"
    )
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    assert "speculation changes the engine's output law" in output and "pit.surprisal (p = " in output
    assert "OpenVINOEngineError" not in output and "UnderpoweredError" not in output


def outside_top_k(tokens: torch.Tensor, prompts: list[list[int]], k: int) -> tuple[int, int]:
    """Tokens of `tokens` [P, n, L] (up to each row's EOS) outside the target's top-k at their prefix,
    and tokens in all, under losscheck's fp32 copy of the target."""
    from losscheck.core.target import load_causal_lm

    model, outside, total = load_causal_lm(bundled.target_path(), "fp32"), 0, 0
    for prompt, rows in zip(prompts, tokens):
        for row in rows.tolist():
            row = row[: row.index(EOS) + 1] if EOS in row else row
            with torch.no_grad():
                logits = model(torch.tensor([prompt + row])).logits[0, len(prompt) - 1 : -1]  # [L, V]
            inside = (logits.topk(k, -1).indices == torch.tensor(row)[:, None]).any(-1)
            outside, total = outside + int((~inside).sum()), total + len(row)
    return outside, total


def test_speculative_sampling_draws_tokens_top_k_excludes():
    """Top-k 8, prefix caching off: with speculation on, over a tenth of the tokens lie outside the
    target's top 8 (probability 0 under the request), with it off under 1% (fp32 differences at the
    cut-off). The finding behind the top-k cell's sample falling short (docs/openvino.md)."""
    ov, prompts, params = engine(prefix_caching=False), all_prompts(), SamplingParams(top_k=8)
    on = outside_top_k(ov.generate(engine_request(prompts, 5, params, 0, 16, True)), prompts, 8)
    off = outside_top_k(ov.generate(engine_request(prompts, 5, params, 0, 16, False)), prompts, 8)
    assert on[0] > 0.1 * on[1] and off[0] < 0.01 * off[1], f"outside the top 8: on {on}, off {off} (of tokens)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("factory", "temperatures"),
    [
        ("bundled_drafter_a_no_prefix_caching", ("T1]", "T0.3]", "T1.5]")),
        ("bundled_drafter_a32_no_prefix_caching", ("T1]", "T0.3]", "T1.5]")),
        # at T 1.5 its rows stop on EOS so often that the cell's sample falls short (an error)
        ("bundled_drafter_a32_tempered2_no_prefix_caching", ("T1]", "T0.3]")),
    ],
)
def test_every_temperature_cell_fails(pytester, factory, temperatures):
    """Greedy passes; the T 1, 0.3 and 1.5 one-sample cells fail by their statistical tests, for
    drafter A, A at head_dim 32 and the tempered stress drafter (docs/openvino.md, 5-8 min an
    engine here)."""
    select = f"test_engine_greedy or (test_engine_sampling and ({' or '.join(temperatures)}))"
    result = certify_engine(pytester, factory, select)
    result.assert_outcomes(passed=1, failed=len(temperatures))
    assert result.stdout.str().count("pit.surprisal FAILED") == len(temperatures)


# --- 3. findings -------------------------------------------------------------------------------------
@pytest.mark.xfail(
    strict=True,
    raises=OpenVINOEngineError,
    reason="OpenVINO GenAI 2026.4.1 speculative sampling with its default scheduler (prefix caching on): "
    "Check 'content_length <= prompt_ids.size() + m_generated_ids.size()' failed (sequence_group.cpp:32), "
    "about half the requests of 16 tokens",
)
def test_speculative_sampling_completes():
    """One T = 1 continuation of 16 tokens per bundled prompt with drafter A drafting 4, the
    pipeline as users build it: every call returns."""
    engine().generate(engine_request(all_prompts(), 1, SamplingParams(), 0, 16, True))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.3), SamplingParams(top_k=8)])
def test_speculative_sampling_completes_and_drafts_without_prefix_caching(params):
    """The same requests with prefix caching off: every call returns, and drafting is on (tau > 1,
    tokens per target step after the prefill)."""
    ov = engine(prefix_caching=False)
    ov.generate(engine_request(all_prompts(), 1, params, 0, 16, True))
    counts = ov.counters()
    assert counts.drafts > 0 and counts.tau > 1.5, counts


def test_after_the_failure_the_pipeline_decodes_without_drafting():
    """Greedy drafts on a fresh pipeline; once a sampled request has failed, the same pipeline answers
    every request (greedy too) with one target step per token and no drafts. Why the adapter drops a
    failed pipeline and refuses a speculative call that drafted nothing."""
    pipe = raw_pipeline()
    greedy = generation_config(GREEDY, 0, 16, EOS, 4)
    before = pipe.generate(ids(all_prompts()[0]), greedy).extended_perf_metrics
    assert before.get_num_draft_tokens() > 0
    for seed, prompt in enumerate(all_prompts()):
        try:
            pipe.generate(ids(prompt), generation_config(SamplingParams(), seed, 16, EOS, 4))
        except RuntimeError as exc:
            assert "content_length <= prompt_ids.size() + m_generated_ids.size()" in str(exc)
            break
    else:
        pytest.fail("no sampled request failed: the finding is gone (docs/openvino.md)")
    for config in (greedy, generation_config(SamplingParams(), 99, 16, EOS, 4)):
        result = pipe.generate(ids(all_prompts()[0]), config)
        metrics = result.extended_perf_metrics
        steps = len(metrics.main_model_metrics.raw_metrics.m_batch_sizes)
        assert metrics.get_num_draft_tokens() == 0 and steps == len(result.tokens[0]) == 16

    stuck = OpenVINOEngine(lambda speculative: pipe, 4, EOS)
    with pytest.raises(OpenVINOEngineError, match="drafted nothing"):
        stuck.generate(engine_request([all_prompts()[0]], 1, GREEDY, 0, 16, True))


def test_drafting_on_and_off_do_not_share_a_random_stream():
    """With the same rng_seed, speculation on (prefix caching off, so that every call returns) and off
    give different continuations of most requests: the seed-for-seed equality that would certify an
    engine exactly does not hold here (on a pipeline that no longer drafts, after a failure, it does)."""
    off, on, same = raw_pipeline(speculative=False), raw_pipeline(prefix_caching=False), 0
    for seed, prompt in enumerate(all_prompts()):
        drafted = on.generate(ids(prompt), generation_config(SamplingParams(), seed, 16, EOS, 4))
        plain = off.generate(ids(prompt), generation_config(SamplingParams(), seed, 16, EOS, None))
        same += drafted.tokens == plain.tokens
    assert same < len(all_prompts()) / 2, f"{same} of {len(all_prompts())} continuations equal seed for seed"


def test_the_certificate_names_the_engine_failure(tmp_path):
    """`losscheck certify` of the engine alone (greedy and the five sampled cells): FAIL, exit status
    1; the greedy cell passes, every sampled cell is listed as errored with OpenVINO's message and the
    engine's name, none retried."""
    command = [
        sys.executable,
        "-m",
        "losscheck.cli",
        "certify",
        "--engine",
        "losscheck.engines.openvino:bundled_drafter_a",
    ]
    command += ["-n", "0", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    cert = json.loads((run / "certificate.json").read_text())
    status = {entry["cell"]: entry["status"] for entry in cert["matrix"]}
    greedy = [cell for cell in status if "greedy" in cell]
    sampled = [cell for cell in status if cell not in greedy]
    assert len(greedy) == 1 and status[greedy[0]] == "passed", status
    assert len(sampled) == 5 and all(status[cell] == "errored" for cell in sampled), status
    text = (run / "certificate.json").read_text()
    assert text.count("sequence_group.cpp") >= 5 and "openvino-genai[drafter_a](k=4)" in text
