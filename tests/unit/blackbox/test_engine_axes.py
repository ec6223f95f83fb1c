"""Engine axes (`losscheck.engines.registry.EngineAxis`): what an adapter declares, the variants it
derives from a request, and how the matrix crosses them with the engine's cells — ids, block
lengths, precisions, the alpha split and the scope. No engine is built."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from losscheck.engines.registry import Adapter, EngineAxis, EngineSpec, option, register
from losscheck.errors import LosscheckError, OptionError
from losscheck.plan import matrix
from losscheck.plan.cell import ENGINE, OWN_TARGET
from losscheck.plan.scope import parse_scope


@dataclass(frozen=True)
class Knobs:
    k: int = option(4, minimum=1)
    cache: str = option("cold", choices=("cold", "warm"))


def _set(key: str):
    def vary(request: EngineSpec, value):
        return None if request.args.get(key) == value else replace(request, args={**request.args, key: value})

    return vary


AXES = (EngineAxis("k", (2, 4), _set("k"), "block length"), EngineAxis("cache", ("warm",), _set("cache"), "cache"))
ADAPTER = Adapter("knobs", "a fake", Knobs, lambda request, name: None, lambda t, r, o: None, None, AXES)


@dataclass
class Engine:
    k: int = 4
    precision: str | None = "fp32"
    name: str = "knobs"


def test_an_adapter_derives_one_variant_per_axis_value_the_request_does_not_have():
    request = EngineSpec("target", args={"k": 4})
    found = [(name, value, varied.args) for name, value, varied in ADAPTER.variants(request)]
    assert found == [("k", 2, {"k": 2}), ("cache", "warm", {"k": 4, "cache": "warm"})]


def test_a_variant_the_adapter_cannot_parse_is_refused_before_any_model_loads():
    bad = replace(ADAPTER, axes=(EngineAxis("cache", ("hot",), _set("cache"), "cache"),))
    with pytest.raises(OptionError, match="cache='hot': need one of"):
        bad.variants(EngineSpec("target"))


def test_register_refuses_two_axes_of_one_name():
    with pytest.raises(LosscheckError, match="repeat a name"):
        register(
            "knobs-twice",
            "a fake",
            options=Knobs,
            inputs=lambda r, n: None,
            build=lambda t, r, o: None,  # type: ignore[arg-type,return-value]
            axes=(AXES[0], AXES[0]),
        )


def test_the_matrix_gives_each_variant_a_greedy_and_a_t1_cell_one_change_from_the_engine():
    variants = [("k", 2), ("k", 4), ("dtype", "bf16"), ("dtype", "fp32"), ("cache", "warm")]
    sampled, greedy = matrix.engine_cells(Engine(), variants)  # type: ignore[arg-type]
    assert [c.id for c in greedy] == [
        "engine-k4-greedy",
        "engine-k2-greedy",
        "engine-k4-greedy-bf16",
        "engine-k4-greedy-cache-warm",
    ]
    assert [c.id for c in sampled][5:] == ["engine-k2-T1", "engine-k4-T1-bf16", "engine-k4-T1-cache-warm"]
    by_id = {c.id: c for c in sampled + greedy}
    assert by_id["engine-k2-T1"].k == 2 and by_id["engine-k2-T1"].variant == (("k", 2),)
    assert by_id["engine-k4-T1-bf16"].precision.target == "bf16" and by_id["engine-k4-T1-bf16"].mode == "one-sample"
    assert all(c.drafter == ENGINE for c in by_id.values())


def test_a_two_sample_engine_names_a_dtype_variant_in_its_id():
    sampled, greedy = matrix.engine_cells(Engine(precision=None), [("dtype", "bf16")])  # type: ignore[arg-type]
    assert greedy[-1].id == "engine-k4-greedy-two-sample-dtype-bf16" and greedy[-1].target == OWN_TARGET
    assert sampled[-1].id == "engine-k4-T1-two-sample-dtype-bf16" and sampled[-1].mode == "two-sample"


def test_a_quantization_variant_of_a_one_sample_engine_is_two_sample():
    sampled, greedy = matrix.engine_cells(Engine(), [("quantization", "q8_0")])  # type: ignore[arg-type]
    assert greedy[-1].id == "engine-k4-greedy-two-sample-quantization-q8_0" and greedy[-1].target == OWN_TARGET
    assert sampled[-1].id == "engine-k4-T1-two-sample-quantization-q8_0" and sampled[-1].mode == "two-sample"
    assert sampled[0].mode == "one-sample"  # the engine as named keeps its reference


def test_the_llamacpp_adapter_declares_a_block_length_and_a_q8_0_target():
    from losscheck.engines.named import ADAPTERS

    request = EngineSpec("target", assistant="drafter")
    found = {(name, value): varied.args for name, value, varied in ADAPTERS["llamacpp"].variants(request)}
    assert found == {("k", 2): {"n_draft": 2}, ("quantization", "q8_0"): {"target_weights": "q8_0"}}
    with pytest.raises(OptionError, match="target_weights='q4_k'"):
        ADAPTERS["llamacpp"].parse(EngineSpec("target", assistant="drafter", args={"target_weights": "q4_k"}))


def test_the_openvino_adapter_declares_a_block_length_and_an_int8_target():
    from losscheck.engines.named import ADAPTERS

    request = EngineSpec("target", assistant="drafter")
    found = {(name, value): varied.args for name, value, varied in ADAPTERS["openvino"].variants(request)}
    assert found == {("k", 2): {"num_assistant_tokens": 2}, ("quantization", "int8"): {"target_weights": "int8"}}


def test_every_variant_cell_takes_a_share_of_alpha_and_the_scope_leaves_axes_out():
    cells = matrix.plan({"main": {}}, None, Engine(), engine_variants=[("k", 2), ("cache", "warm")])  # type: ignore[arg-type]
    assert matrix.statistical_tests(cells) == 5 + 2
    base = cells[matrix.ENGINE_CELL][0].precision
    kept, out = parse_scope("-cache").split(cells, base)
    assert [o["cell"] for o in out] == ["engine-k4-T1-cache-warm", "engine-k4-greedy-cache-warm"]
    assert out[0]["reason"] == "-cache declared out"
    kept, out = parse_scope("-engine-axes").split(cells, base)
    assert len(out) == 4 and all(not c.variant for found in kept.values() for c in found)
    kept, _ = parse_scope("engine-greedy,-k").split(cells, base)
    assert [c.id for found in kept.values() for c in found] == ["engine-k4-greedy", "engine-k4-greedy-cache-warm"]


def test_the_scope_knows_the_engine_axes_by_name():
    parse_scope("-cache").check(("split", "prefix", "batching"), ("k", "cache"))
    with pytest.raises(OptionError, match=r"cache \(an axis of the engine\)"):
        parse_scope("-cash").check(("split",), ("k", "cache"))


def test_the_vllm_adapter_declares_its_axes_as_variants_of_the_request():
    from losscheck.engines.named import ADAPTERS

    spec = {"method": "draft_model", "model": "drafter", "num_speculative_tokens": 4}
    request = EngineSpec("target", speculative_config=spec, args={"max_model_len": 256})
    found = {(name, value): varied for name, value, varied in ADAPTERS["vllm"].variants(request)}
    assert list(found) == [
        ("k", 2),
        ("dtype", "bf16"),
        ("prefix", "warm"),
        ("chunked_prefill", "on"),
        ("method", "ngram"),
        ("tensor_parallel", 2),
        ("max_num_seqs", 1),
        ("arrivals", "staggered"),
    ]
    assert found["tensor_parallel", 2].args == {
        "max_model_len": 256,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    assert found["max_num_seqs", 1].args == {"max_model_len": 256, "max_num_seqs": 1}
    # the eagle3 value only where a checkpoint is named
    named = replace(request, args={"max_model_len": 256, "losscheck_eagle3": "heads"})
    eagle = {(n, v): r for n, v, r in ADAPTERS["vllm"].variants(named)}["method", "eagle3"]
    assert eagle.speculative_config == {"method": "eagle3", "model": "heads", "num_speculative_tokens": 4}
    assert found["arrivals", "staggered"].args == {"max_model_len": 256, "losscheck_in_flight": 16}
    assert found["k", 2].speculative_config == {**spec, "num_speculative_tokens": 2}
    assert found["dtype", "bf16"].args == {"max_model_len": 256, "dtype": "bf16"}
    assert found["prefix", "warm"].args == {
        "max_model_len": 256,
        "enable_prefix_caching": True,
        "losscheck_warm_prefix": True,
    }
    chunked = found["chunked_prefill", "on"].args
    assert chunked["enable_chunked_prefill"] is True and chunked["max_num_batched_tokens"] <= 16  # below most prompts
    assert found["method", "ngram"].speculative_config == {
        "method": "ngram",
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "num_speculative_tokens": 4,
    }
    # what the request already has is no variant
    ngram = replace(request, speculative_config=found["method", "ngram"].speculative_config)
    assert ("method", "ngram") not in [(n, v) for n, v, _ in ADAPTERS["vllm"].variants(ngram)]
