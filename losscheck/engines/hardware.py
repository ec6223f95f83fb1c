"""A black-box engine's instances (`losscheck.engines.pool`) sized for hardware before anything
loads: the instance policy a run's engine gets by default, and `--plan-for 1xH100-80GB`.

Terms:
- *hardware*: `COUNTxNAME-MEMGB`, devices of one kind and the memory of each (`parse_hardware`);
  the machine's own, read from torch (`present`), when a run builds its engine;
- *instance*: one engine (speculation on, or off) on the devices: the target's weights in the
  engine's precision split over its tensor-parallel ranks, its draft model's, and room for its KV
  cache (`KV_SHARE` of the weights, at least `KV_MIN_GIB`);
- *reference*: losscheck's own copy of the target on one device while it scores: in the engine's
  precision for one-sample cells, fp32 for two-sample cells (the proxy); with the engine's draft
  model beside it in fp32 when losscheck teacher-forces one (off the device while an instance lives).

The policy follows (`fit`): both instances and the reference alive together (keep-all) where they
fit in `ENGINE_SHARE` of a device; else one at a time, each instance given that share
(vLLM's default `gpu_memory_utilization`); else the plan is infeasible, refused with the numbers.
An engine axis whose value needs more devices than there are (`DEVICE_AXES`) is out of scope on
that hardware. Sizes come from config.json alone (`parameters`), so a directory without weights
is enough. Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from losscheck.engines.pool import Policy
from losscheck.errors import OptionError

GIB = 1024**3
ENGINE_SHARE = 0.9  # of a device, for what the engine holds (vLLM's default gpu_memory_utilization)
KV_SHARE, KV_MIN_GIB = 0.1, 1.0  # an instance's KV cache and activations beside its weights
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# engine axes whose value is a device count (`losscheck.engines.registry.EngineAxis`)
DEVICE_AXES = ("tensor_parallel",)
_HARDWARE = re.compile(r"([1-9][0-9]*)x([A-Za-z][A-Za-z0-9]*)-([1-9][0-9]*(?:\.[0-9]+)?)GB")
HARDWARE_FORM = "COUNTxNAME-MEMGB, e.g. 1xH100-80GB, 2xL40S-48GB, 1xH200-141GB"


@dataclass(frozen=True)
class Hardware:
    devices: int
    name: str
    gib: float  # memory of one device, GiB (a device sold as 80 GB holds about 80 GiB)

    @property
    def label(self) -> str:
        return f"{self.devices}x{self.name}-{self.gib:g}GB"


def parse_hardware(text: str, option: str = "--plan-for") -> Hardware:
    """`COUNTxNAME-MEMGB` as `Hardware`, strictly; anything else a usage error naming `option`."""
    found = _HARDWARE.fullmatch(text.strip())
    if found is None:
        raise OptionError(f"{option}={text!r}: need {HARDWARE_FORM} (devices x name - memory of each in GB)")
    return Hardware(int(found.group(1)), found.group(2), float(found.group(3)))


def present() -> Hardware | None:
    """The accelerators of this machine (CUDA), or None on a CPU."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return Hardware(torch.cuda.device_count(), props.name.replace(" ", ""), props.total_memory / GIB)


def parameters(config: Mapping[str, Any]) -> int:
    """Parameters of a decoder from its config.json (a multimodal model's `text_config`): embeddings,
    attention per layer (a hybrid's linear-attention layers by their own widths, `layer_types`),
    the MLP per layer (a dense one, or every expert, the router and a shared expert), norms, and an
    untied LM head. Exact for Llama, Mixtral and Qwen3-Next layouts (tests/unit/test_hardware_plan.py)."""
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
    vocab = int(text["vocab_size"])
    qwen3 = str(text.get("model_type", "")).startswith("qwen3")
    gated = bool(text.get("attn_output_gate", text.get("model_type") == "qwen3_next"))  # q_proj also gives a gate
    attention = hidden * head_dim * ((3 if gated else 2) * heads + 2 * kv_heads)  # q (and gate), o; k, v
    attention += 2 * head_dim if qwen3 else 0  # q_norm, k_norm
    if experts > 1:
        inner = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 4 * hidden)
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * hidden * inner * experts + hidden * experts  # gate, up, down per expert; router
        mlp += 3 * hidden * shared + hidden if shared else 0  # the shared expert and its gate
    else:
        mlp = 3 * hidden * int(text.get("intermediate_size") or 4 * hidden)
    kinds = list(text.get("layer_types") or [])[:layers]
    linear = kinds.count("linear_attention")
    mixing = (layers - linear) * attention + (linear * _linear_attention(text, hidden) if linear else 0)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    return mixing + layers * (mlp + 2 * hidden) + hidden + vocab * hidden * (1 if tied else 2)


def _linear_attention(text: Mapping[str, Any], hidden: int) -> int:
    """One gated delta-net layer (Qwen3-Next's `linear_attention`): its q, k, v, z and b, a
    projections, the depthwise convolution over q, k, v, its decay and step parameters, the
    output norm and projection."""
    v_heads, v_dim = int(text["linear_num_value_heads"]), int(text["linear_value_head_dim"])
    key = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    value = v_heads * v_dim
    projections = hidden * (2 * key + 2 * value) + hidden * 2 * v_heads + value * hidden
    return projections + (2 * key + value) * int(text.get("linear_conv_kernel_dim") or 4) + 2 * v_heads + v_dim


@dataclass(frozen=True)
class Sizing:
    """What a run holds, in GiB, from the configs."""

    target_params: int
    draft_params: int  # the engine's draft model (0: none, or none losscheck can read)
    engine_precision: str  # "fp32", "bf16", "fp16"
    reference_precision: str  # the precision losscheck's copy of the target scores in
    tensor_parallel: int = 1

    def instance_gib(self) -> float:
        weights = (self.target_params + self.draft_params) * BYTES[self.engine_precision] / GIB / self.tensor_parallel
        return weights + max(KV_MIN_GIB, KV_SHARE * weights)

    def reference_gib(self) -> float:
        """losscheck's copy of the target while it scores, and beside it the engine's draft model,
        teacher-forced in fp32 (`losscheck.run.models.Models.place_drafts`)."""
        target = self.target_params * BYTES[self.reference_precision] / GIB
        return (target + self.draft_params * BYTES["fp32"] / GIB) * (1 + KV_SHARE / 2)  # activations


@dataclass(frozen=True)
class HardwarePlan:
    hardware: Hardware
    sizing: Sizing
    policy: str  # "keep-all" or "one-at-a-time" (`losscheck.engines.pool.Policy` values)
    memory_fraction: float  # each instance's gpu_memory_utilization

    def lines(self) -> list[str]:
        hw, s = self.hardware, self.sizing
        share = ENGINE_SHARE * hw.gib
        together = 2 * s.instance_gib() + s.reference_gib()
        why = (
            f"two instances and the reference ({together:.1f} GiB) fit in {share:.1f} GiB "
            f"({ENGINE_SHARE:g} of a device)"
            if self.policy == "keep-all"
            else f"two instances and the reference ({together:.1f} GiB) do not fit in {share:.1f} GiB "
            f"({ENGINE_SHARE:g} of a device): one engine instance or the reference alive at a time"
        )
        split = f", split over {s.tensor_parallel} devices" if s.tensor_parallel > 1 else ""
        return [
            f"hardware plan for {hw.label} ({hw.devices} device(s) of {hw.gib:g} GiB; sizes from config.json: "
            f"target {s.target_params / 1e9:.2f}B parameters, draft model {s.draft_params / 1e9:.2f}B):",
            f"  engine instance: {s.instance_gib():.1f} GiB a device ({s.engine_precision} weights{split}, "
            f"KV cache {KV_SHARE:g} of them, at least {KV_MIN_GIB:g} GiB)",
            f"  reference target: {s.reference_gib():.1f} GiB on one device ({s.reference_precision}, scoring"
            + (", the draft model beside it in fp32)" if s.draft_params else ")"),
            f"  policy: {self.policy} — {why}; each instance gets gpu_memory_utilization {self.memory_fraction:.2f}",
        ]

    def phase_gib(self, alive_target: bool) -> float:
        return self.sizing.reference_gib() if alive_target else self.sizing.instance_gib()


def fit(hardware: Hardware, sizing: Sizing) -> HardwarePlan:
    """The plan `sizing` gets on `hardware`: keep-all where everything fits at once, else one at a
    time; an instance or a reference larger than a device is refused with the numbers."""
    share = ENGINE_SHARE * hardware.gib
    instance, reference = sizing.instance_gib(), sizing.reference_gib()
    if sizing.tensor_parallel > hardware.devices:
        raise OptionError(
            f"--plan-for={hardware.label}: the engine splits over {sizing.tensor_parallel} devices, "
            f"{hardware.devices} given"
        )
    problems = []
    if instance > share:
        problems.append(f"an engine instance needs {instance:.1f} GiB a device, more than {share:.1f} GiB")
    if reference > hardware.gib:
        problems.append(
            f"the reference target ({sizing.reference_precision}) needs {reference:.1f} GiB, more than one "
            f"device's {hardware.gib:g} GiB"
        )
    if problems:
        raise OptionError(
            f"the run does not fit {hardware.label}: {'; '.join(problems)}; give larger or more devices "
            "(--engine-arg tensor_parallel_size=N), or a lower precision (--engine-arg dtype=bfloat16)"
        )
    if 2 * instance + reference <= share:
        return HardwarePlan(hardware, sizing, "keep-all", _fraction(instance / hardware.gib))
    return HardwarePlan(hardware, sizing, "one-at-a-time", ENGINE_SHARE)


def _fraction(share: float) -> float:
    """An instance's memory fraction: its need rounded up to a twentieth."""
    return min(ENGINE_SHARE, math.ceil(share * 20) / 20)


def devices_needed(axis: str, value: int | str) -> int:
    """Devices an engine variant at `axis`=`value` runs on (1 unless the axis counts devices)."""
    return int(value) if axis in DEVICE_AXES else 1


def chosen_policy(target: str, draft: str | None, precision: str, reference: str, tensor_parallel: int) -> Policy:
    """The instance policy of an engine whose memory policy was not given: keep-all on a CPU (no
    accelerator to share), else what `fit` gives the machine's accelerators for the model
    directories `target` and `draft` (None: no draft model losscheck can read)."""
    hardware = present()
    if hardware is None:
        return Policy.KEEP_ALL
    sizing = Sizing(parameters_of(target), parameters_of(draft), precision, reference, tensor_parallel)
    return Policy(fit(hardware, sizing).policy)


def chosen_proxy(
    asked: str, target: str, draft: str | None, tensor_parallel: int = 1, hardware: Hardware | None = None
) -> str:
    """The precision of the proxy a two-sample engine cell is sized and scored through
    (`--losscheck-proxy-precision`): `asked` unless "auto"; fp32 on a CPU (`hardware` None: the
    machine's, `present`) or where the plan fits an fp32 proxy; else the target's own dtype, which
    loses the proxy power only (its tests keep their level whatever the proxy is). Where neither
    fits, fp32: the run's plan then refuses it with the numbers."""
    if asked != "auto":
        return asked
    hardware = hardware if hardware is not None else present()
    if hardware is None:
        return "fp32"
    declared = declared_precision(_config_of(target))
    for reference in ("fp32", declared):
        sizing = Sizing(parameters_of(target), parameters_of(draft), declared, reference, tensor_parallel)
        try:
            fit(hardware, sizing)
        except OptionError:
            continue
        return reference
    return "fp32"


def declared_precision(config: Mapping[str, Any]) -> str:
    """The precision a config.json declares its weights in (`torch_dtype`; bf16 when it names none)."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(config.get("torch_dtype")), "bf16")


def _config_of(directory: str | None) -> dict[str, Any]:
    """A model directory's config.json ({} when there is none)."""
    import json
    from pathlib import Path

    config = Path(directory).expanduser() / "config.json" if directory else None
    return json.loads(config.read_text()) if config is not None and config.is_file() else {}


def parameters_of(directory: str | None) -> int:
    """`parameters` of a model directory's config.json (0: no directory, or no config.json in it)."""
    config = _config_of(directory)
    return parameters(config) if config else 0
