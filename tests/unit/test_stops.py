"""Stop strings (`losscheck.core.stops`): the rule, the options, the end check, the black-box
path's lengths and leak check, and the two stop-string mutants against the correct rule."""

from __future__ import annotations

import pytest
import torch

from losscheck.cells.ends import EndCounts, end_problems, ends_in_blocks
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.grammar import BUNDLED_TEXTS
from losscheck.core.sampling import SamplingParams
from losscheck.core.stops import StopStrings, first_stop, parse_stop_strings
from losscheck.engines import EngineOutputError, checked_samples, request_lengths
from losscheck.errors import OptionError
from losscheck.plan.sampling_spec import parse_sampling
from losscheck.selftest.end_bugs import stop_string_at_round_end, stop_string_tokens_kept
from tests.support import engine_request

ID = {text: i for i, text in enumerate(BUNDLED_TEXTS) if text}  # the bundled vocabulary: one id a character
EOS, V = 1, len(BUNDLED_TEXTS)


def ids(text: str) -> list[int]:
    return [ID[c] for c in text]


def decode(tokens: list[int]) -> str:
    return "".join(BUNDLED_TEXTS[i] for i in tokens)


@pytest.mark.parametrize(
    ("text", "start", "strings", "min_tokens", "expected"),
    [
        ("xabab", 0, ("ab",), 0, 2),  # the first completion
        ("xabab", 3, ("ab",), 0, 4),  # tokens before `start` were searched: a string ending there is old
        ("xabab", 0, ("ab",), 3, 4),  # completed before min tokens: not a stop (vLLM's rule)
        ("xabab", 0, ("ba", "xa"), 0, 1),  # the string that completes first wins, whatever its order
        ("xabab", 0, ("abab",), 0, 4),  # a string of four tokens
        ("xabab", 0, ("cd",), 0, None),
    ],
)
def test_the_first_token_that_completes_a_string(text, start, strings, min_tokens, expected) -> None:
    assert first_stop(decode, ids(text), start, strings, min_tokens) == expected


def test_a_string_completed_across_a_round_boundary_is_found_from_the_new_tokens() -> None:
    # "a" closed the last round, "b" opens this one: searched from index 2, the string ends at 2
    assert first_stop(decode, ids("xab"), 2, ("ab",), 0) == 2


def test_stop_strings_parse_and_refuse_what_they_cannot_be() -> None:
    assert parse_stop_strings("ab,cd").strings == ("ab", "cd")
    assert parse_stop_strings('["a,b", "c d"]').strings == ("a,b", "c d")
    assert StopStrings(("ab", "ab")).strings == ("ab",)
    params = parse_sampling("stop_strings=rR,44", tokenizer="/some/tokenizer")
    assert params.stop_strings == StopStrings(("rR", "44"), "/some/tokenizer")
    assert params.label() == "T1-stopstr_rR_44"
    for bad, message in (
        ("[1, 2]", "non-empty strings"),
        ("[oops", "not a JSON list"),
        (",", "non-empty strings"),
        ("[]", "non-empty strings"),
        ('["ab", ""]', "non-empty strings"),
    ):
        with pytest.raises(OptionError, match=message):
            parse_stop_strings(bad)


def test_the_bundled_vocabulary_refuses_another_target() -> None:
    with pytest.raises(OptionError, match="bundled main target's 64 ids, this target has 32"):
        StopStrings(("ab",)).decode(32)


def _gen(rows: list[str], budget: int = 6, min_tokens: int = 0, slots: list[list[int]] | None = None) -> Generation:
    tokens = torch.full((len(rows), budget), EOS, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(ids(row), dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    params = SamplingParams(stop_strings=StopStrings(("ab",)), min_tokens=min_tokens)
    stats = LoopStats.empty(2 if slots is not None else 0)
    slot = None if slots is None else torch.tensor(slots)
    return Generation(tokens, lengths, stats, params, slots=slot)


def test_the_end_check_reads_stop_strings() -> None:
    assert end_problems(_gen(["xab", "ccccdd", "xyab"]), EOS, V) == []
    (leak,) = end_problems(_gen(["xabc", "ccccdd"]), EOS, V)
    assert "1 of 2 rows emitted tokens after an end token (EOS or a stop id) or a completed stop string" in leak
    assert "row 0: 4 tokens, first end at 2" in leak
    (silent,) = end_problems(_gen(["xa"]), EOS, V)
    assert "stopped before their budget with no end token or a completed stop string" in silent
    assert end_problems(_gen(["abcab"], min_tokens=3), EOS, V) == []  # the first "ab" came before min tokens
    with pytest.raises(ValueError, match="vocabulary size"):
        end_problems(_gen(["xab"]), EOS)


def test_ends_in_blocks_counts_rows_ended_by_a_string_before_their_rounds_last_slot() -> None:
    # k = 2: slots 0, 1 are drafts' places, 2 the bonus; row 0 ends at slot 1 (inside), row 1 at slot 2
    gen = _gen(["xab", "xyab"], slots=[[0, 0, 1, 0, 0, 0], [0, 1, 0, 2, 0, 0]])
    assert ends_in_blocks(gen, EOS, V) == EndCounts(ends=0, ends_in_block=0, string_ends=2, string_ends_in_block=1)


def test_black_box_rows_end_at_the_completing_token_and_a_row_past_it_is_malformed() -> None:
    params = SamplingParams(stop_strings=StopStrings(("ab",)))
    rows = torch.tensor([[ids("xab")[0], ID["a"], ID["b"], EOS, EOS], ids("ccabc")])
    assert request_lengths(rows, EOS, params, V).tolist() == [3, 4]
    engine = type("E", (), {"name": "leaky"})()
    asked = engine_request([[0]], 2, params, 0, 5, True)
    with pytest.raises(EngineOutputError, match=r"1 rows go on after the token that completed a stop string"):
        checked_samples(engine, rows[None], asked, V, EOS)  # type: ignore[arg-type]
    good = rows.clone()
    good[1, 4] = EOS
    assert torch.equal(checked_samples(engine, good[None], asked, V, EOS), good[None])  # type: ignore[arg-type]


def test_the_mutants_differ_from_the_rule_only_inside_a_block() -> None:
    strings = ("ab",)
    round_ = ids("xabcd")  # one round emitted five tokens; "ab" completed by its third
    assert first_stop(decode, round_, 0, strings, 0) == 2
    assert stop_string_at_round_end(decode, round_, 0, strings, 0) is None  # missed: the text ends in "cd"
    assert stop_string_tokens_kept(decode, round_, 0, strings, 0) == 4  # found, the round's tokens kept
    one = ids("xab")  # the string completed by the round's last token: all three agree
    assert first_stop(decode, one, 2, strings, 0) == stop_string_at_round_end(decode, one, 2, strings, 0) == 2
    assert stop_string_tokens_kept(decode, one, 2, strings, 0) == 2


def test_engines_that_take_no_stop_strings_refuse_them_by_name() -> None:
    from losscheck.engines.served import UnsupportedParameter, refuse

    params = SamplingParams(stop_strings=StopStrings(("ab",)))
    with pytest.raises(UnsupportedParameter, match=r"engine 'x' cannot serve stop_strings=\['ab'\]"):
        refuse(params, "x", ())


def test_a_string_the_vocabulary_cannot_spell_or_a_target_without_a_tokenizer_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(OptionError, match=r"stop_strings \['a!'\]: the target's vocabulary cannot spell them"):
        SamplingParams(stop_strings=StopStrings(("ab", "a!"))).check_vocab(V)
    with pytest.raises(OptionError, match="stop strings need the target's tokenizer: .* has none"):
        StopStrings(("ab",), str(tmp_path)).check(V)
    StopStrings(("the", ". "), "fixtures/text_target").check(8192)  # byte-level BPE spells any text


def test_the_command_line_refuses_an_unspellable_stop_string_before_any_run() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "losscheck.cli", "certify", "--sampling", "stop_strings=a!", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "the target's vocabulary cannot spell them" in done.stderr, done.stderr[-2000:]
