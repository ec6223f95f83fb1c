"""The unit tier loads no weights: a test here that reads a model's weights fails, naming the
tier it belongs in."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors
    import safetensors.torch
    from transformers import PreTrainedModel

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test loaded weights: move it to tests/cells (the bundled models in process)")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
