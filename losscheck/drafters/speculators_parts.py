"""What the speculators-format drafters share (`losscheck.drafters.speculators` for EAGLE-3 and
P-EAGLE, `losscheck.drafters.dspark` for DFlash and DSpark): the weights read by their published
names into a network, the draft vocabulary's map checked, a slot drawn over that vocabulary, and
the checkpoint's identity in a certificate.

**Vocabulary.** Draft id i is target id `i + d2t[i]` (`t2d` marks the target ids covered); `q`
is reported over the draft vocabulary with that map (`Proposal.vocab_map`), zero elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from torch import nn

from losscheck.core.contract import DraftContext, Target
from losscheck.core.sampling import sample
from losscheck.drafters.speculators_config import CheckpointConfig, TargetShape
from losscheck.errors import OptionError
from losscheck.hashing import content_hash

IGNORED = ("verifier_lm_head.", "verifier_norm.")  # the library's frozen copies of the verifier's


def vocab_map(d2t: torch.Tensor) -> torch.Tensor:
    """[V_d] target id of each draft id (`d2t [V_d]` offsets)."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def load_weights(cfg: CheckpointConfig, net: nn.Module, target: Target) -> None:
    """Fill `net` (parameter names as the checkpoint's, buffers `d2t` and `t2d`) from the
    checkpoint's safetensors; the embedding from the target when the checkpoint leaves it out (as
    published drafters may). An `OptionError` names what is missing, extra or misshapen."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(cfg.path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    # older EAGLE-3 releases name the first decoder layer `midlayer`
    state = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith(IGNORED)}
    if "embed_tokens.weight" not in state:
        embed = getattr(getattr(target, "model", None), "get_input_embeddings", lambda: None)()
        if embed is None or tuple(embed.weight.shape) != (cfg.target_vocab_size, cfg.hidden_size):
            raise OptionError(
                f"speculators checkpoint {str(cfg.path)!r} has no embed_tokens.weight and the target's "
                "embedding cannot stand in for it (it is a Hugging Face target's, of the same shape)"
            )
        state["embed_tokens.weight"] = embed.weight.detach().float().cpu()
    if "d2t" not in state and cfg.draft_vocab_size != cfg.target_vocab_size:
        raise OptionError(
            f"speculators checkpoint {str(cfg.path)!r} drafts over {cfg.draft_vocab_size} tokens of the "
            f"target's {cfg.target_vocab_size} but has no d2t mapping"
        )
    expected = set(net.state_dict())
    missing = sorted(expected - set(state) - {"d2t", "t2d"})
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise OptionError(
            f"speculators checkpoint {str(cfg.path)!r} does not match its {cfg.model_type} config: "
            f"missing weights {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, tensor in net.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise OptionError(
                f"speculators checkpoint {str(cfg.path)!r}: {name} has shape {tuple(state[name].shape)}, "
                f"its config implies {tuple(tensor.shape)}"
            )
    net.load_state_dict(state, strict=False)
    check_vocab_map(cfg, net.get_buffer("d2t"), net.get_buffer("t2d"))


def check_vocab_map(cfg: CheckpointConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    ids = vocab_map(d2t)
    where = f"speculators checkpoint {str(cfg.path)!r}"
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.target_vocab_size or int(ids.unique().numel()) != ids.numel():
        raise OptionError(
            f"{where}: d2t maps draft ids outside the target's {cfg.target_vocab_size} tokens or two "
            "draft ids onto one target id"
        )
    covered = t2d.bool()
    if int(covered.sum()) != cfg.draft_vocab_size or not bool(covered[ids].all()):
        raise OptionError(
            f"{where}: t2d marks {int(covered.sum())} target ids, not exactly the "
            f"{cfg.draft_vocab_size} that d2t maps to"
        )


def is_full_vocab(cfg: CheckpointConfig, ids: torch.Tensor) -> bool:
    """Whether the draft vocabulary is the target's, id for id (`ids [V_d]` the map)."""
    return cfg.draft_vocab_size == cfg.target_vocab_size and bool(
        (ids == torch.arange(len(ids), device=ids.device)).all()
    )


def draw(
    logits: torch.Tensor, ctx: DraftContext, drafted: torch.Tensor, ids: torch.Tensor, target_vocab: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V_d] after `drafted [B, j]` (target ids) → (drafted target id [B], q over the
    draft vocabulary [B, V_d]); `ids [V_d]` the vocabulary map, `target_vocab` None when the draft
    vocabulary is the target's. History steps read target ids: with a sub-vocabulary the logits
    are spread onto the target's (-inf where the drafter has no token) and back."""
    if ctx.params.reads_history and target_vocab is not None:
        spread = logits.float().new_full((len(logits), target_vocab), -math.inf)
        q = ctx.process(spread.index_copy(-1, ids, logits.float()), drafted)[:, ids]
    else:
        q = ctx.process(logits.float(), drafted)
    draft = q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator)
    return ids[draft], q


def target_shape_of(target: Target) -> TargetShape:
    return TargetShape(
        f"target {target.name!r}",
        target.vocab_size,
        target.hidden_size,
        int(getattr(target, "num_layers", 0)),
        tuple(getattr(target, "architectures", ())),
    )


def identity(cfg: CheckpointConfig, precision: str) -> dict[str, object]:
    """The checkpoint as a certificate names it."""
    found: dict[str, object] = {
        "format": "speculators",
        "algorithm": cfg.algorithm,
        "speculators_model_type": cfg.model_type,
        "path": str(cfg.path.resolve()),
        "sha256": content_hash(cfg.path),
        "proposal": asdict(cfg.proposal),
        "verifier": {"name_or_path": cfg.verifier_name, "architectures": list(cfg.verifier_architectures)},
        "aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "draft_vocab_size": cfg.draft_vocab_size,
        "precision": precision,
    }
    if cfg.block is not None:
        found["block"] = asdict(cfg.block)
    return found
