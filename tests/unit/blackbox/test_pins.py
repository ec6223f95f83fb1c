"""What an engine certificate pins (`losscheck.engines.pins`): the engine package's installed
version, the draft model's content hash, the options; and the runtime's CUDA driver."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata

from losscheck.engines.pins import draft_model, engine_pins, package_versions
from losscheck.engines.registry import EngineSpec
from losscheck.hashing import content_hash, model_sha256
from losscheck.report.manifest import nvidia_driver


def test_a_package_is_pinned_by_its_installed_distribution():
    assert package_versions("transformers.generation") == {"transformers": importlib.metadata.version("transformers")}
    assert package_versions("no_such_module_here") == {}  # a module of the working directory: no distribution


def test_a_draft_model_is_pinned_by_its_content_whatever_its_form(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "README.md").write_text("not hashed")
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_sha256(hf) == content_hash(hf)
    assert model_sha256(gguf) == hashlib.sha256(b"draft.gguf" + b"GGUF").hexdigest()
    assert model_sha256(tmp_path / "org/model-on-a-hub") is None
    request = EngineSpec(target="t", speculative_config={"method": "draft_model", "model": str(gguf)})
    assert draft_model(request) == {"path": str(gguf), "sha256": model_sha256(gguf)}
    assert draft_model(EngineSpec(target="t", assistant=str(hf)))["sha256"] == content_hash(hf)  # type: ignore[index]
    assert draft_model(EngineSpec(target="t", speculative_config={"method": "ngram"})) is None


class Policy(enum.Enum):
    KEEP = "keep-all"


@dataclasses.dataclass(frozen=True)
class Options:
    seed: int = 0
    policy: Policy = Policy.KEEP


def test_the_options_and_the_speculative_config_are_pinned_as_json():
    config = {"method": "ngram", "num_speculative_tokens": 4}
    pins = engine_pins("transformers", EngineSpec(target="t", speculative_config=config), Options())
    assert pins["options"] == {"seed": 0, "policy": "keep-all", "speculative_config": config}
    assert "draft_model" not in pins and pins["package"] == package_versions("transformers")


def test_the_driver_version_is_read_from_the_kernel_modules_line(tmp_path):
    version = tmp_path / "version"
    for line, expected in [
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)",
            "580.95.05",
        ),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
    ]:
        version.write_text(line + "\nGCC version:  gcc version 12.2.0\n")
        assert nvidia_driver(version) == expected
    assert nvidia_driver(tmp_path / "absent") is None
