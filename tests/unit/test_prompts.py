"""User prompt files: parsing errors name the line, text goes through the target's tokenizer (and
its chat template on request), untiered prompts are placed by the target's entropy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from losscheck.errors import OptionError
from losscheck.run.prompts import HIGH_ENTROPY, LOW_ENTROPY, read_jsonl, tier_of, tokenize, user_prompt_sets
from tests.support import ROOT, tiny_target

TEXT_TARGET = ROOT / "fixtures" / "text_target"


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not JSON"),
        ({"text": "a", "ids": [1]}, 'exactly one of "text" or "ids"'),
        ({"prompt": "a"}, 'exactly one of "text" or "ids"'),
        ({"text": ""}, '"text" must be a non-empty string'),
        ({"ids": [1, "2"]}, '"ids" must be a non-empty list of integers'),
        ({"ids": [1], "tier": "medium"}, '"tier" must be one of'),
    ],
)
def test_a_malformed_line_is_named(tmp_path, line, message):
    with pytest.raises(OptionError, match=message):
        read_jsonl(write(tmp_path, {"ids": [1, 2]}, line))


def test_a_missing_or_empty_file_is_an_error(tmp_path):
    with pytest.raises(OptionError, match="no such file"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(OptionError, match="holds no prompt"):
        read_jsonl(write(tmp_path, ""))


def test_entropy_thresholds():
    assert [tier_of(h) for h in (0.0, LOW_ENTROPY - 1e-9, LOW_ENTROPY, HIGH_ENTROPY - 1e-9, HIGH_ENTROPY)] == [
        "low",
        "low",
        "mid",
        "mid",
        "high",
    ]


def test_text_goes_through_the_targets_tokenizer_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TEXT_TARGET, local_files_only=True)
    records = [{"text": "import os\n"}, {"ids": [5, 6]}]
    plain = tokenize(records, TEXT_TARGET, chat_template=False)
    assert plain == [tok("import os\n")["input_ids"], [5, 6]]
    chat = tokenize(records[:1], TEXT_TARGET, chat_template=True)[0]
    assert tok.decode(chat).endswith("### assistant:\n") and len(chat) > len(plain[0])


def test_text_prompts_need_a_tokenizer(tmp_path):
    with pytest.raises(OptionError, match="need the target's tokenizer"):
        tokenize([{"text": "hi"}], None, chat_template=False)
    with pytest.raises(OptionError, match="need a tokenizer in the target directory"):
        tokenize([{"text": "hi"}], tmp_path, chat_template=False)


def test_untiered_prompts_are_placed_by_the_targets_entropy(tmp_path):
    target = tiny_target()
    path = write(tmp_path, {"ids": [0, 3, 4], "tier": "high"}, {"ids": [0, 5]}, {"ids": [0, 7, 9]})
    sets = user_prompt_sets(path, target, None, chat_template=False)
    from losscheck.run.prompts import next_token_entropy

    entropies = next_token_entropy(target, [[0, 5], [0, 7, 9]])
    import scipy.stats
    import torch

    for prompt, h in zip([[0, 5], [0, 7, 9]], entropies):  # one unpadded plain forward each
        logits = target.model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
        assert h == pytest.approx(scipy.stats.entropy(logits.softmax(-1).detach().numpy()), abs=1e-5)
    expected = {"high": [[0, 3, 4]]}
    for prompt, h in zip([[0, 5], [0, 7, 9]], entropies):
        expected.setdefault(tier_of(h), []).append(prompt)
    assert {t: sorted(p) for t, p in sets.items()} == {t: sorted(p) for t, p in expected.items()}


def test_ids_outside_the_vocabulary_are_named(tmp_path):
    target = tiny_target()
    with pytest.raises(OptionError, match="line 3: the prompt has ids \\[999\\] outside the target's vocabulary"):
        user_prompt_sets(write(tmp_path, {"ids": [0, 1]}, "", {"ids": [0, 999]}), target, None, chat_template=False)


def test_a_prompt_longer_than_the_targets_positions_is_named_by_its_line(tmp_path):
    target = tiny_target(max_positions=16)
    path = write(tmp_path, {"ids": [0, 1]}, "", {"ids": [0] * 12})
    assert user_prompt_sets(path, target, None, False, room=4)  # 12 + 4 fits
    with pytest.raises(OptionError, match="line 3: the prompt is 12 tokens long; with the 5 tokens a cell gener"):
        user_prompt_sets(path, target, None, chat_template=False, room=5)


def test_the_room_is_the_most_tokens_a_cell_generates():
    from losscheck.plan.profiles import PROFILES, Profile
    from losscheck.run.prompts import new_tokens

    assert new_tokens(PROFILES["ci"]) == PROFILES["ci"].greedy_max_new == 64
    assert new_tokens(PROFILES["thorough"]) == 128
    assert new_tokens(Profile("short", greedy_max_new=8)) == 2 * 16 + 2  # a k = 16 PIT cell's horizon


@pytest.mark.parametrize("prefix", ["--losscheck-", "--"])
def test_the_start_up_check_names_a_long_prompts_line_and_the_callers_option(tmp_path, prefix):
    """`losscheck certify` checks with prefix "--" (its --prompts), pytest with "--losscheck-"."""
    from losscheck.run.loading import check_options
    from losscheck.run.options import Options

    path = write(tmp_path, {"ids": [0, 1]}, {"ids": [0] * 200})  # the bundled target: 256 positions
    with pytest.raises(OptionError) as error:
        check_options(Options(prompts=str(path)), prefix=prefix)
    assert str(error.value).startswith(f"{prefix}prompts='{path}' line 2: the prompt is 200 tokens long")
    assert "shorten it to at most 192 tokens" in str(error.value)
    check_options(Options(prompts=str(write(tmp_path, {"ids": [0] * 192}))), prefix=prefix)  # 192 + 64 fits


def test_prompt_messages_name_the_callers_options(tmp_path):
    with pytest.raises(OptionError, match="^--prompts='.*' line 1: not JSON"):
        read_jsonl(write(tmp_path, "{not json"), prefix="--")
    with pytest.raises(OptionError, match="^--prompts: text prompts .* or a --target directory with a tokenizer"):
        tokenize([{"text": "hi"}], None, chat_template=False, prefix="--")
    plain = tmp_path / "no_chat_template"  # the text target's tokenizer without its chat template
    plain.mkdir()
    config = json.loads((TEXT_TARGET / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    (plain / "tokenizer.json").write_bytes((TEXT_TARGET / "tokenizer.json").read_bytes())
    with pytest.raises(OptionError, match="^--chat-template: the tokenizer in .* has no chat template"):
        tokenize([{"text": "hi"}], plain, chat_template=True, prefix="--")
