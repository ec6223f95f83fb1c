"""The target adapter: a Hugging Face causal LM loaded from a local path, with a ragged cache."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from losscheck.core.precision import torch_dtype
from losscheck.core.ragged import RaggedLM
from losscheck.core.recurrent import RaggedStateCache, cache_for, has_state, layer_kinds
from losscheck.errors import TargetError
from losscheck.hashing import content_hash

if TYPE_CHECKING:  # importing transformers costs seconds; only the loaders below need it at run time
    from transformers import PreTrainedModel


def load_causal_lm(
    path: str | Path,
    precision: str = "fp32",
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    tp_plan: Literal["auto"] | None = None,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path)` offline, safetensors only, on `device`, in eval mode.

    `tp_plan` ("auto": the model's own plan) splits it over the ranks of the initialised
    `torch.distributed` process group (`losscheck.serving.split`); transformers then places each
    rank's shard on that rank's device itself."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise TargetError(
            f"model directory {str(path)!r} does not exist; pass a local Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    if not any(path.glob("*.safetensors")):
        raise TargetError(
            f"{str(path)!r} has no *.safetensors weights; losscheck loads safetensors only "
            "(convert with model.save_pretrained(dir, safe_serialization=True))"
        )
    split: dict[str, object] = {}
    if tp_plan is not None:
        from transformers.distributed import DistributedConfig

        split["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    try:
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=torch_dtype(precision),
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                local_files_only=True,
                attn_implementation="sdpa",
                **split,
            )
    except Exception as exc:  # transformers raises many types; name the model and the cause
        raise TargetError(f"could not load a causal LM from {str(path)!r}: {exc}") from exc
    # transformers declares `to` through functools.wraps, whose typeshed type does not bind `self`
    return (model if split else model.to(device)).eval()  # type: ignore[arg-type]


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No "Loading weights" progress bar: models load during collection, outside pytest's
    capture, and one bar per model per worker buries the run's own output."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


class HFTarget:
    """A `losscheck.core.contract.Target` over any Hugging Face `*ForCausalLM` module."""

    def __init__(self, model: PreTrainedModel, name: str, identity: dict[str, str]) -> None:
        config = model.config
        self.model = model
        self.kinds = layer_kinds(config)  # per layer: "attention" or a recurrent kind
        self.lm = RaggedLM(model, cache_for(self.kinds))
        self.stateful = has_state(self.kinds)  # recurrent layers: the engine calls `keep` after each forward
        self.name = name
        self.identity = identity
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)  # layer ids 0..num_layers, see Target
        self.architectures: tuple[str, ...] = tuple(getattr(config, "architectures", None) or ())
        eos = config.eos_token_id
        self.eos_id: int | None = eos[0] if isinstance(eos, list) else eos
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device

    def move(self, device: str | torch.device) -> None:
        """Its weights to `device` (a draft model teacher-forced on the accelerator between engine
        phases, `losscheck.run.models.Models.place_drafts`)."""
        self.model.to(device)  # type: ignore[arg-type]  # transformers types .to by its own class
        self.device = self.lm.device = next(self.model.parameters()).device
        self.lm.cache = None  # a cache built on the other device

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        precision: str = "fp32",
        trust_remote_code: bool = False,
        device: str | torch.device = "cpu",
        tp_plan: Literal["auto"] | None = None,
    ) -> HFTarget:
        """`tp_plan`: split over the ranks of the initialised process group (`load_causal_lm`);
        the identity then records the split, `{"split": ranks}`."""
        path = Path(path)
        model = load_causal_lm(path, precision, trust_remote_code, device, tp_plan)
        identity = {"path": str(path.resolve()), "sha256": content_hash(path), "precision": precision}
        if tp_plan is not None:
            import torch.distributed as dist

            identity["split"] = str(dist.get_world_size())
        return cls(model, name=path.name, identity=identity)

    @classmethod
    def skeleton(cls, path: str | Path, precision: str = "fp32", trust_remote_code: bool = False) -> HFTarget:
        """The model of `path` built from its config.json on the meta device: its shapes and
        declarations without reading (or hashing) a weight, for planning a run."""
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch_dtype(precision), trust_remote_code=trust_remote_code
            )
        return cls(model.eval(), name=path.name, identity={"path": str(path.resolve()), "precision": precision})

    def reset(self, batch_size: int, capacity: int) -> None:
        self.lm.reset(batch_size, capacity)

    def forward(
        self, tokens: torch.Tensor, start: torch.Tensor, layers: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.checked(self.lm.forward(tokens, start, layers=layers))

    def keep(self, counts: torch.Tensor) -> None:
        """Each row the last forward read keeps its first `counts` [n] tokens (`StatefulTarget`)."""
        self.lm.keep(counts)

    def with_lm(self, lm: RaggedLM) -> HFTarget:
        """A copy of this target, the same weights, running `lm` (another way to keep the cache:
        rollback by replay, a planted state bug)."""
        copied = copy.copy(self)
        copied.lm = lm
        return copied

    def expect(self, counts: torch.Tensor) -> None:
        """The next forward's rows keep at least `counts` [n] tokens (`losscheck.core.contract.expect_rows`)."""
        if isinstance(self.lm.cache, RaggedStateCache):
            self.lm.cache.expect(counts)

    def checked(self, out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`out` = (logits, hidden) if every logit is finite, else `TargetError` naming the target."""
        # a finite sum says every logit is finite (NaN and inf propagate); only a sum that
        # overflows or is not finite reads them one by one (a full pass: 45 ms on 48 × 16 × 8,192)
        if not (torch.isfinite(out[0].sum()) or torch.isfinite(out[0]).all()):
            raise TargetError(f"target {self.name!r} produced NaN/inf logits")
        return out
