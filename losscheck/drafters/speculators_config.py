"""The speculators checkpoint format, read natively: `config.json` and what it promises.

A speculators checkpoint (the format vLLM serves; github.com/vllm-project/speculators) is a
directory with `config.json` and `*.safetensors`. Its config is a Hugging Face config with:

- `speculators_model_type`: the architecture (`eagle3`, `peagle`, `dflash`, `dspark`, ...);
- `speculators_config`: `algorithm`, `proposal_methods` (each with a `proposal_type`; the greedy
  one has `speculative_tokens`, `verifier_accept_k`, `accept_tolerance`),
  `default_proposal_method`, and `verifier` (`name_or_path`, `architectures`);
- the drafter's own fields: `transformer_layer_config` (a Llama / Qwen3 decoder config),
  `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (EAGLE) or `aux_hidden_state_layer_ids`
  (DFlash, DSpark), norm switches, `mask_token_id`; DFlash and DSpark add `block_size` and
  `sample_from_anchor`, DSpark its heads (`markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`) and vLLM's `dspark_draft_topk`.

This module parses and checks that much without torch, so `--losscheck-drafter=speculators:PATH`
is checked at start-up against the target's config.json; `losscheck.drafters.speculators` builds
the model. The `speculators` library itself is not a dependency: it pins torch and transformers
to versions losscheck does not (see docs/drafter-contract.md), and the checkpoint format is the contract.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from losscheck.errors import OptionError

PREFIX = "speculators:"
CHAIN_ALGORITHMS = ("eagle3", "peagle")  # losscheck.drafters.speculators
BLOCK_ALGORITHMS = ("dflash", "dspark")  # losscheck.drafters.dspark
ALGORITHMS = CHAIN_ALGORITHMS + BLOCK_ALGORITHMS  # speculators_model_type values losscheck runs
# speculators_model_type values of drafters that losscheck recognises but does not run, and why:
# named, not refused as unknown
RECOGNISED = {
    "mtp": "a speculators-format MTP module (num_nextn_predict_layers) is not read yet; a target checkpoint "
    "that carries its MTP layers is certified with losscheck.drafters.mtp:from_target, and an engine that "
    "serves the module with --engine vllm",
}
MARKOV_HEADS = ("vanilla", "gated", "rnn")  # DSpark's markov_head_type values (speculators 0.9)
DEFAULT_WIDTH = 8  # the truncation width a DSpark checkpoint is also certified at when it sets none
LAYER_TYPES = ("llama", "qwen3")  # transformer_layer_config.model_type values losscheck builds
# the library's defaults for fields a config may leave out (speculators 0.9 config classes)
DEFAULT_SPECULATIVE_TOKENS = 5


def is_spec(spec: str | None) -> bool:
    """Whether a `--losscheck-drafter` value names a speculators checkpoint."""
    return spec is not None and spec.startswith(PREFIX)


def spec_path(spec: str) -> Path:
    return Path(spec[len(PREFIX) :]).expanduser()


@dataclass(frozen=True)
class GreedyProposal:
    """The greedy proposal method: a chain of `speculative_tokens` drafts, verified top-1 — or,
    with `verifier_accept_k > 1`, accepted anywhere in the verifier's top-k whose log-probability
    is within `accept_tolerance` of the top token's (lossy; 0 tolerance is top-1 again)."""

    speculative_tokens: int
    verifier_accept_k: int = 1
    accept_tolerance: float = 0.0

    @property
    def relaxed(self) -> bool:
        """Whether the configured acceptance differs from exact verification."""
        return self.verifier_accept_k > 1 and self.accept_tolerance > 0

    def describe(self) -> str:
        return (
            f"greedy proposal, speculative_tokens={self.speculative_tokens}, "
            f"verifier_accept_k={self.verifier_accept_k}, accept_tolerance={self.accept_tolerance}"
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """What losscheck reads from a speculators `config.json`."""

    path: Path
    model_type: str  # speculators_model_type
    algorithm: str
    proposal: GreedyProposal
    verifier_name: str | None
    verifier_architectures: tuple[str, ...]
    layer_config: dict[str, Any]  # transformer_layer_config, as written
    hidden_size: int  # the drafter's
    target_hidden_size: int  # of the verifier states it reads (target_hidden_size or hidden_size)
    target_vocab_size: int  # the verifier's (transformer_layer_config.vocab_size)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # eagle_aux_hidden_state_layer_ids
    mask_token_id: int | None = None  # P-EAGLE's placeholder token; DFlash's and DSpark's mask token
    flags: dict[str, bool] = field(default_factory=dict)  # norm_before_residual, norm_before_fc, fc_norm, norm_output
    block: BlockDrafting | None = None  # DFlash and DSpark

    @property
    def layer_type(self) -> str:
        return str(self.layer_config.get("model_type", "llama"))


@dataclass(frozen=True)
class BlockDrafting:
    """What a DFlash or DSpark checkpoint adds to the format: one forward drafts a block.

    `sample_from_anchor` False (DFlash's layout): the block is the anchor (the last committed
    token) and k mask tokens, and output j (1..k) is draft j-1, so at most `block_size - 1`
    drafts. True (DSpark's): the anchor and k-1 mask tokens, and output j (0..k-1) is draft j,
    at most `block_size`. DSpark's Markov head (`markov_rank` > 0) adds to each slot's logits a
    low-rank bias read from the token before it (the anchor for the first); `draft_topk`
    (vLLM's `dspark_draft_topk`) keeps only that many of the backbone's top logits per slot."""

    block_size: int
    sample_from_anchor: bool
    markov_rank: int = 0  # 0: no Markov head (DFlash)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    draft_topk: int | None = None

    @property
    def max_drafts(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


def _fail(path: Path, problem: str) -> OptionError:
    return OptionError(f"speculators checkpoint {str(path)!r}: {problem}")


def read_config(path: str | Path) -> CheckpointConfig:
    """Parse and check `path/config.json`; `OptionError` naming the field and the fix."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise _fail(path, "no such directory; pass speculators:DIR, a local checkpoint (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise _fail(path, "has no config.json")
    if not any(path.glob("*.safetensors")):
        raise _fail(path, "has no *.safetensors weights")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise _fail(path, f"cannot read config.json ({exc})") from exc
    spec = raw.get("speculators_config")
    if not isinstance(spec, dict):
        raise _fail(
            path,
            "config.json has no speculators_config; this is not a speculators-format checkpoint "
            "(a plain Hugging Face drafter directory is --losscheck-drafter=DIR)",
        )
    model_type = raw.get("speculators_model_type")
    if model_type in RECOGNISED:
        raise _fail(
            path,
            f"speculators_model_type {model_type!r}, which losscheck recognises but does not run: "
            + RECOGNISED[model_type],
        )
    if model_type not in ALGORITHMS:
        raise _fail(path, f"speculators_model_type {model_type!r} is not supported; losscheck runs {list(ALGORITHMS)}")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "llama") not in LAYER_TYPES:
        found = layer.get("model_type") if isinstance(layer, dict) else layer
        raise _fail(
            path,
            f"transformer_layer_config model_type {found!r} is not supported; losscheck builds {list(LAYER_TYPES)}",
        )
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(layer.get(key), int):
            raise _fail(path, f"transformer_layer_config lacks the integer {key!r}")
    verifier = spec.get("verifier") or {}
    hidden = int(layer["hidden_size"])
    aux_key = "aux_hidden_state_layer_ids" if model_type in BLOCK_ALGORITHMS else "eagle_aux_hidden_state_layer_ids"
    aux = raw.get(aux_key)
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) for i in aux):
        # the library resolves a missing list from the verifier's depth; a checkpoint losscheck
        # certifies must say which layers it was trained on
        raise _fail(path, f"{aux_key} is {aux!r}; it must list the verifier layers the drafter reads")
    mask = raw.get("mask_token_id")
    if model_type in ("peagle", *BLOCK_ALGORITHMS) and not isinstance(mask, int):
        raise _fail(path, f"a {model_type} checkpoint needs an integer mask_token_id (the placeholder of its block)")
    block = _block(path, raw, model_type, int(raw.get("draft_vocab_size") or layer["vocab_size"]))
    return CheckpointConfig(
        path=path,
        model_type=str(model_type),
        algorithm=str(spec.get("algorithm", model_type)),
        proposal=_proposal(path, spec),
        verifier_name=verifier.get("name_or_path"),
        verifier_architectures=tuple(verifier.get("architectures") or ()),
        layer_config=layer,
        hidden_size=hidden,
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layers=tuple(aux),
        mask_token_id=mask if isinstance(mask, int) else None,
        flags={
            key: bool(raw.get(key, False))
            for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        },
        block=block,
    )


def _block(path: Path, raw: dict[str, Any], model_type: str, draft_vocab: int) -> BlockDrafting | None:
    """The block fields of a DFlash or DSpark config.json, with the library's defaults (speculators
    0.9: block 8; DSpark samples from the anchor, rank-256 vanilla Markov head, confidence head
    reading the Markov embedding)."""
    if model_type not in BLOCK_ALGORITHMS:
        return None
    dspark = model_type == "dspark"
    block = BlockDrafting(
        block_size=_int(path, raw, "block_size", 8),
        sample_from_anchor=_bool(path, raw, "sample_from_anchor", dspark),
        markov_rank=_int(path, raw, "markov_rank", 256) if dspark else 0,
        markov_head_type=str(raw.get("markov_head_type", "vanilla")) if dspark else "vanilla",
        confidence_head=_bool(path, raw, "enable_confidence_head", True) if dspark else False,
        confidence_with_markov=_bool(path, raw, "confidence_head_with_markov", True) if dspark else False,
        draft_topk=raw.get("dspark_draft_topk") if dspark else None,
    )
    if block.max_drafts < 1:
        raise _fail(
            path, f"block_size {block.block_size} leaves no draft slot; need at least 2 (1 with sample_from_anchor)"
        )
    if block.markov_rank < 0 or block.markov_head_type not in MARKOV_HEADS:
        raise _fail(
            path,
            f"markov_rank {block.markov_rank}, markov_head_type {block.markov_head_type!r}: need rank >= 0 "
            f"(0: no head) and a type in {list(MARKOV_HEADS)}",
        )
    if block.confidence_head and block.confidence_with_markov and block.markov_rank == 0:
        raise _fail(path, "confidence_head_with_markov needs a Markov head (markov_rank > 0); set it false")
    topk = block.draft_topk
    if topk is not None and not (isinstance(topk, int) and 1 <= topk <= draft_vocab):
        raise _fail(path, f"dspark_draft_topk {topk!r}: need an integer in 1..{draft_vocab} (the draft vocabulary)")
    return block


def _bool(path: Path, raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise _fail(path, f"{key} is {value!r}; it must be true or false")
    return value


def block_lengths(cfg: CheckpointConfig) -> tuple[int, ...]:
    """The k a DFlash or DSpark checkpoint drafts: 1 up to its layout's and its proposal's limit."""
    assert cfg.block is not None, "a DFlash or DSpark checkpoint"
    return tuple(range(1, min(cfg.block.max_drafts, cfg.proposal.speculative_tokens) + 1))


def block_widths(cfg: CheckpointConfig) -> tuple[int | None, ...]:
    """A DSpark checkpoint's truncation widths: full, and its `dspark_draft_topk` (DEFAULT_WIDTH
    when it sets none); none without a Markov head."""
    assert cfg.block is not None, "a DFlash or DSpark checkpoint"
    return (None, cfg.block.draft_topk or DEFAULT_WIDTH) if cfg.block.markov_rank else ()


def _int(path: Path, raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(path, f"{key} is {value!r}; it must be an integer")
    return value


def _proposal(path: Path, spec: dict[str, Any]) -> GreedyProposal:
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method", "greedy")
    chosen = [m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default]
    if not chosen:
        raise _fail(
            path,
            f"default_proposal_method {default!r} is not among proposal_methods "
            f"{[m.get('proposal_type') for m in methods if isinstance(m, dict)]}",
        )
    if default != "greedy":
        raise _fail(path, f"proposal method {default!r} is not supported; losscheck runs the 'greedy' (chain) proposal")
    method = chosen[0]
    proposal = GreedyProposal(
        speculative_tokens=int(method.get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)),
        verifier_accept_k=int(method.get("verifier_accept_k", 1)),
        accept_tolerance=float(method.get("accept_tolerance", 0.0)),
    )
    if proposal.speculative_tokens < 1 or proposal.verifier_accept_k < 1 or proposal.accept_tolerance < 0:
        raise _fail(
            path,
            f"invalid {proposal.describe()}: need speculative_tokens >= 1, verifier_accept_k >= 1, "
            "accept_tolerance >= 0",
        )
    return proposal


@dataclass(frozen=True)
class TargetShape:
    """The facts about a target a checkpoint is checked against (from its config.json or model)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    architectures: tuple[str, ...]


def target_shape(config: dict[str, Any], name: str) -> TargetShape:
    """A target's `TargetShape` from its config.json (a nested text_config's fields too)."""
    inner = config.get("text_config") or {}

    def get(key: str) -> Any:  # a config.json value, untyped JSON
        return config.get(key) or inner.get(key)

    return TargetShape(
        name,
        int(get("vocab_size")),
        int(get("hidden_size")),
        int(get("num_hidden_layers")),
        tuple(config.get("architectures") or ()),
    )


def check_against(cfg: CheckpointConfig, target: TargetShape) -> None:
    """The checkpoint was built for a verifier like `target`: same architecture (when the
    checkpoint names one), vocabulary and hidden size, and the layers it reads exist."""
    where = f"speculators checkpoint {str(cfg.path)!r} (verifier {cfg.verifier_name!r})"
    problems = []
    if (
        cfg.verifier_architectures
        and target.architectures
        and not set(cfg.verifier_architectures) & set(target.architectures)
    ):
        problems.append(
            f"verifier architectures {list(cfg.verifier_architectures)}, the target is {list(target.architectures)}"
        )
    if cfg.target_vocab_size != target.vocab_size:
        problems.append(f"verifier vocabulary {cfg.target_vocab_size} tokens, the target has {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"verifier hidden size {cfg.target_hidden_size}, the target has {target.hidden_size}")
    bad = [i for i in cfg.aux_layers if not 0 <= i <= target.num_layers]
    if bad or len(set(cfg.aux_layers)) != len(cfg.aux_layers):
        problems.append(
            f"aux hidden state layer ids {list(cfg.aux_layers)}: the target's layer ids are "
            f"0..{target.num_layers}, each at most once"
        )
    if cfg.block is not None and cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is not an id of the target's {target.vocab_size} tokens")
    if cfg.draft_vocab_size > target.vocab_size:
        problems.append(
            f"draft vocabulary {cfg.draft_vocab_size} tokens is larger than the target's {target.vocab_size}"
        )
    if problems:
        raise OptionError(
            f"{where} does not fit {target.name}: "
            + "; ".join(problems)
            + ". Certify it against the verifier it was trained for (--losscheck-target=DIR)"
        )
