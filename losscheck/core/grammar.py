"""Structured output: a token-level grammar — a regex or a JSON schema — compiled with xgrammar,
the library behind vLLM's structured outputs, and the ids it allows after each output prefix.

A grammar reads the output only (not the prompt). After a prefix it has left (an id it does not
allow was emitted: a lossy engine's doing), nothing is masked: the law there is the unconstrained
one, and the token that left it already has probability 0 (a support failure).

The bundled main target has no tokenizer: its ids 2..63 spell the 62 characters of
`BUNDLED_TEXTS` (0 and 1, BOS and EOS, spell nothing), so a regex over those characters
constrains it as a real grammar constrains a real model. Any other target names its tokenizer
directory (`Grammar.vocabulary`).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from losscheck.errors import OptionError

BUNDLED = "bundled"
BUNDLED_TEXTS = ("", "") + tuple(string.ascii_lowercase + string.digits + string.ascii_uppercase)  # 64 ids
KINDS = ("regex", "json")


@dataclass(frozen=True)
class Grammar:
    """kind: "regex" (a regular expression over the output's text) or "json" (a JSON schema);
    source: the pattern or the schema's JSON text; vocabulary: `BUNDLED` (the bundled main
    target's `BUNDLED_TEXTS`) or a Hugging Face tokenizer directory."""

    kind: str
    source: str
    vocabulary: str = BUNDLED

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptionError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json":
            try:
                json.loads(self.source)
            except ValueError as exc:
                raise OptionError(f"grammar json: the schema is not JSON ({exc})") from None

    def label(self) -> str:
        return f"{self.kind}{hashlib.sha256(self.source.encode()).hexdigest()[:6]}"


def parse_grammar(text: str) -> Grammar:
    """ "regex:PATTERN" or "json:SCHEMA" → a `Grammar` over the bundled vocabulary, compiled
    now so that an unparsable one is an `OptionError` before any run."""
    kind, sep, source = text.partition(":")
    if not sep or kind not in KINDS:
        raise OptionError(f"grammar {text!r}: write regex:PATTERN or json:SCHEMA")
    grammar = Grammar(kind, source)
    _compiled(grammar, len(BUNDLED_TEXTS), (1,))
    return grammar


def write_bundled_tokenizer(path: str | Path) -> Path:
    """A Hugging Face tokenizer directory at `path` for the bundled main target, one id per
    character of `BUNDLED_TEXTS` (0 and 1: `<s>` and `</s>`, special): what an engine whose
    structured outputs compile a grammar against its tokenizer (vLLM's) needs to constrain that
    target as `mask_logits` does. Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1} | {text: i for i, text in enumerate(BUNDLED_TEXTS) if text}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return Path(path)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise OptionError(
            "a grammar cell needs xgrammar (the library of vLLM's structured outputs): pip install 'xgrammar>=0.2.8' "
            "(from a checkout: pip install -e '.[grammar]')"
        ) from None
    return xgrammar


@cache
def _compiled(grammar: Grammar, vocab: int, stops: tuple[int, ...]) -> Any:
    """The grammar compiled for a vocabulary of `vocab` ids that stops at `stops`."""
    xgr = _xgrammar()
    if grammar.vocabulary == BUNDLED:
        if vocab != len(BUNDLED_TEXTS):
            raise OptionError(
                f"a grammar over the bundled vocabulary needs the bundled main target's {len(BUNDLED_TEXTS)} ids, "
                f"this target has {vocab}; name the target's tokenizer directory as the grammar's vocabulary"
            )
        info = xgr.TokenizerInfo(list(BUNDLED_TEXTS), vocab_size=vocab, stop_token_ids=list(stops))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(grammar.vocabulary)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(stops))
    compiler = xgr.GrammarCompiler(info)
    try:
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.source)
        return compiler.compile_json_schema(grammar.source)
    except RuntimeError as exc:  # xgrammar's message, less its log prefix "[hh:mm:ss] file.cc:line: "
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip().splitlines()[0])
        raise OptionError(f"grammar {grammar.kind}:{grammar.source!r} does not compile: {reason}") from None


def mask_logits(
    logits: torch.Tensor, grammar: Grammar, outputs: list[list[int]], continuation: torch.Tensor, stops: tuple[int, ...]
) -> torch.Tensor:
    """`logits [B, m, V]` with the ids the grammar disallows at -inf, in place: position i of row b
    follows `outputs[b]` and `continuation [B, m-1]`'s first i tokens."""
    xgr = _xgrammar()
    rows, m, vocab = logits.shape
    compiled = _compiled(grammar, vocab, stops)
    bitmask = xgr.allocate_token_bitmask(rows * m, vocab)  # [B·m, ⌈V/32⌉], all allowed
    drafts = continuation.tolist()
    for b in range(rows):
        matcher = xgr.GrammarMatcher(compiled)
        inside = True
        for token in outputs[b]:  # a finished row's junk past its stop is never accepted
            if matcher.is_terminated() or not matcher.accept_token(token):
                inside = False
                break
        for i in range(m):
            if not inside or matcher.is_terminated():
                break  # left the grammar (or ended): nothing masked from here
            matcher.fill_next_token_bitmask(bitmask, b * m + i)
            if i < m - 1:
                inside = matcher.accept_token(drafts[b][i])
    flat = logits.view(rows * m, vocab)
    xgr.apply_token_bitmask_inplace(flat, bitmask.to(flat.device), vocab_size=vocab)
    return logits
