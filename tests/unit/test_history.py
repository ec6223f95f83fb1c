"""History-dependent processing (`losscheck.core.history`, `losscheck.core.grammar`): each position
of a block reads the committed output and the block's tokens before it, exactly as plain decoding
reads them one token at a time; the parameters' validation names each bad value."""

from __future__ import annotations

import math

import pytest
import torch

from losscheck.core.contract import DraftContext
from losscheck.core.grammar import BUNDLED_TEXTS, Grammar, parse_grammar
from losscheck.core.history import History, adjust_logits
from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.errors import OptionError

V = 64


def _history(prompt: list[list[int]], output: list[list[int]], eos: int | None = 1) -> History:
    rows = [p + o for p, o in zip(prompt, output, strict=True)]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return History(tokens, torch.tensor(list(map(len, rows))), torch.tensor(list(map(len, prompt))), eos)


def _one_at_a_time(logits, params, history, continuation):
    """The reference: position i alone, its continuation committed first (plain decoding's view)."""
    out = []
    for i in range(logits.shape[1]):
        seen = history.extended(continuation[:, :i])
        out.append(adjust_logits(logits[:, i : i + 1], params, seen, continuation[:, :0]))
    return torch.cat(out, 1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8),
        SamplingParams(frequency_penalty=0.6),
        SamplingParams(min_tokens=5, stop_ids=(7,)),
        SamplingParams(logit_bias={3: 2.0, 9: -1.0}),
        SamplingParams(banned_ids=(4, 11)),
        SamplingParams(grammar=Grammar("regex", "([a-z][0-9])+")),
    ],
    ids=lambda p: p.label(),
)
def test_a_block_is_processed_as_plain_decoding_processes_it_token_by_token(params):
    g = torch.Generator().manual_seed(0)
    history = _history([[0, 5, 6], [0, 7]], [[2, 30, 5], []])  # ids 2 / 30: "a" / "2"
    logits = torch.randn(2, 4, V, generator=g)
    continuation = torch.tensor([[3, 3, 30], [2, 2, 4]])
    block = adjust_logits(logits, params, history, continuation)
    assert torch.equal(block, _one_at_a_time(logits, params, history, continuation))
    assert not torch.equal(block, logits), "the parameter changed nothing: the test would not see a bug"


def test_penalties_count_prompt_and_output_as_vllm_does():
    history = _history([[0, 5]], [[6, 6]])
    logits = torch.full((1, 2, V), 2.0)
    logits[..., 9] = -2.0
    rep = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), history, torch.tensor([[9]]))
    assert rep[0, 0, 5] == 1.0 and rep[0, 0, 6] == 1.0 and rep[0, 0, 7] == 2.0  # prompt and output: / 2
    assert rep[0, 0, 9] == -2.0 and rep[0, 1, 9] == -4.0  # negative: x 2, once the draft 9 is output
    freq = adjust_logits(logits, SamplingParams(frequency_penalty=0.5), history, torch.tensor([[6]]))
    assert freq[0, 0, 6] == 1.0 and freq[0, 1, 6] == 0.5 and freq[0, 0, 5] == 2.0  # output only, by count
    pres = adjust_logits(logits, SamplingParams(presence_penalty=0.5), history, torch.tensor([[6]]))
    assert pres[0, 1, 6] == 1.5 and pres[0, 0, 5] == 2.0  # once, output only


def test_min_tokens_masks_eos_and_stop_ids_until_the_output_is_long_enough():
    history = _history([[0]], [[2, 3]])  # 2 output tokens so far
    out = adjust_logits(
        torch.zeros(1, 3, V), SamplingParams(min_tokens=4, stop_ids=(8,)), history, torch.tensor([[5, 6]])
    )
    masked = torch.isinf(out[0, :, [1, 8]]).all(-1)  # EOS (1) and the stop id
    assert masked.tolist() == [True, True, False]  # outputs of 2, 3 tokens masked; at 4 free


def test_min_p_keeps_tokens_within_the_ratio_of_the_most_probable_after_temperature():
    logits = torch.tensor([[0.0, -1.0, -3.0]])
    probs = process_logits(logits, SamplingParams(temperature=1.0, min_p=math.exp(-2)))
    assert probs[0, 2] == 0 and probs[0, 1] > 0
    assert process_logits(logits, SamplingParams(temperature=2.0, min_p=math.exp(-2)))[0, 2] > 0  # e^-1.5 > e^-2


def test_the_drafter_processes_q_with_its_drafts_before_the_slot():
    history = _history([[0, 5]], [[6]])
    params = SamplingParams(frequency_penalty=1.0)
    ctx = DraftContext(
        history.tokens, history.lengths, None, 2, None, params, torch.Generator(), history.prompt_lengths
    )
    logits = torch.zeros(1, V)
    q = ctx.process(logits, torch.tensor([[6]]))  # id 6 twice in the output by now
    expected = process_logits(
        adjust_logits(
            logits[:, None], params, history.extended(torch.tensor([[6]])), torch.zeros(1, 0, dtype=torch.long)
        )[:, 0],
        params,
    )
    assert torch.equal(q, expected) and q[0, 6] < q[0, 5]


def test_the_grammar_allows_what_the_regex_allows_after_each_prefix():
    grammar = Grammar("regex", "([a-z][0-9])+")
    history = _history([[0]], [[]])
    letter, digit = BUNDLED_TEXTS.index("a"), BUNDLED_TEXTS.index("7")
    out = adjust_logits(torch.zeros(1, 3, V), SamplingParams(grammar=grammar), history, torch.tensor([[letter, digit]]))
    allowed = [{BUNDLED_TEXTS[i] or i for i in torch.isfinite(row).nonzero().squeeze(1).tolist()} for row in out[0]]
    assert allowed[0] == set("abcdefghijklmnopqrstuvwxyz")
    assert allowed[1] == set("0123456789")
    assert allowed[2] == set("abcdefghijklmnopqrstuvwxyz") | {1}  # a pair is complete: EOS may end it


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"presence_penalty": math.inf}, "presence_penalty must be a finite number"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"logit_bias": {3: math.nan}}, "logit_bias values must be finite"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias names an id twice"),
        ({"banned_ids": (-1,)}, "banned_ids must hold token ids"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(kwargs, message):
    with pytest.raises(OptionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_ids_are_checked_against_the_vocabulary_and_a_grammar_must_compile():
    with pytest.raises(OptionError, match=r"logit_bias names ids \[70\] outside the vocabulary"):
        SamplingParams(logit_bias={70: 1.0}).check_vocab(V)
    with pytest.raises(OptionError, match="bans every id"):
        SamplingParams(banned_ids=tuple(range(8))).check_vocab(8)
    with pytest.raises(OptionError, match="does not compile"):
        parse_grammar("regex:([a-z")
    with pytest.raises(OptionError, match="write regex:PATTERN or json:SCHEMA"):
        parse_grammar("ebnf:root ::= 'a'")
    with pytest.raises(OptionError, match="the schema is not JSON"):
        parse_grammar("json:{type")


def test_parameters_normalise_and_label_each_knob():
    params = SamplingParams(logit_bias={9: -1.0, 3: 2.0}, banned_ids=(7, 2, 7))
    assert params.logit_bias == ((3, 2.0), (9, -1.0)) and params.banned_ids == (2, 7)
    assert params.label() == "T1-bias3+2_9-1-ban2_7"
    assert hash(params) == hash(SamplingParams(logit_bias=((3, 2.0), (9, -1.0)), banned_ids=(2, 7)))
    assert not SamplingParams().reads_history and SamplingParams(min_tokens=1).reads_history


def test_a_users_target_gets_the_grammar_cell_over_its_own_tokenizer_or_none(tmp_path):
    """The planned grammar cell spells its regex in the bundled target's characters; on a user's
    target it compiles against the target's tokenizer, and without one it is left out (it errored
    on every user target with another vocabulary before). The stop-string cell likewise."""
    from losscheck.core.grammar import BUNDLED
    from losscheck.plan.matrix import history_variants
    from losscheck.plan.tiers import HISTORY_VARIANTS
    from losscheck.run.session import _vocabulary

    assert history_variants(BUNDLED) == HISTORY_VARIANTS
    grammars = [p.grammar for p in history_variants("fixtures/hybrid_target") if p.grammar is not None]
    assert [g.vocabulary for g in grammars] == ["fixtures/hybrid_target"]
    stops = [p.stop_strings for p in history_variants("fixtures/hybrid_target") if p.stop_strings is not None]
    assert [s.vocabulary for s in stops] == ["fixtures/hybrid_target"]
    assert len(history_variants(None)) == len(HISTORY_VARIANTS) - 2
    assert not any(p.grammar or p.stop_strings for p in history_variants(None))
    assert _vocabulary(None) == BUNDLED and _vocabulary(str(tmp_path)) is None
    assert _vocabulary("fixtures/hybrid_target") == "fixtures/hybrid_target"


def test_the_per_round_state_plant_starts_afresh_on_a_new_batch_in_a_reused_buffer():
    """The planted per-round state (`PerRoundState`) restarts at a batch's first round even when
    the new batch's token buffer sits at the freed one's address (the allocator reuses it): else
    the rounds counted for the last batch carried into the next, and the plant's effect depended
    on what ran before it (an engine cell's attribution stage once passed in CI for that)."""
    from losscheck.selftest.history_bugs import PerRoundState

    plant = PerRoundState(counts_tokens=False, counts_rounds=True)
    params = SamplingParams(min_tokens=3, stop_ids=(5,))
    tokens = torch.tensor([[2, 3, 7, 8, 9, 0]])  # one buffer, as a reused address would give
    prompt = torch.tensor([2])
    for length in (2, 3, 4):  # three rounds of the first batch
        plant(torch.zeros(1, 2, 8), params, History(tokens, torch.tensor([length]), prompt, 1), tokens[:, :1])
    assert plant._rounds.tolist() == [2]
    plant(torch.zeros(1, 2, 8), params, History(tokens, prompt.clone(), prompt, 1), tokens[:, :1])  # a new batch
    assert plant._rounds.tolist() == [0]
