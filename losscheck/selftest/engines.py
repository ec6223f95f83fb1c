"""Planted verifier bugs in losscheck's own loop behind the black-box interface
(`losscheck.engines.spec_loop`): engines that report only their tokens, whose drafter losscheck can
load, so their one-sample cells judge the verifier's bug classes through the round filter
(`losscheck.stats.hidden_rounds`). Select one like any engine:
`--losscheck-engine=losscheck.selftest.engines:residual_is_p`.
"""

from __future__ import annotations

import dataclasses

import torch

from losscheck.core.contract import DraftContext, Target
from losscheck.core.verify import Verifier
from losscheck.drafters.autoregressive import AutoregressiveDrafter
from losscheck.engines.hf import HFAnswer, HFAssistedEngine
from losscheck.engines.request import GenerationRequest
from losscheck.engines.spec_loop import SpecLoopEngine
from losscheck.selftest.verifiers import (
    in_sampled_rounds,
    on_share_of_rounds,
    verify_bonus_from_wrong_slot,
    verify_greedy_at_any_temperature,
    verify_residual_is_p,
    verify_temperature_on_q_only,
)
from losscheck.stats.buglaws import TARGET_TEMPERATURE_FACTOR

PLANTED: dict[str, Verifier] = {
    "residual-is-p": in_sampled_rounds(verify_residual_is_p),
    "residual-is-p-half": in_sampled_rounds(on_share_of_rounds(verify_residual_is_p, 0.5)),
    "bonus-from-previous-slot": in_sampled_rounds(verify_bonus_from_wrong_slot),
    "temperature-on-q-only": verify_temperature_on_q_only,
    "greedy-at-any-temperature": verify_greedy_at_any_temperature,
}


def planted(target: Target, bug: str) -> SpecLoopEngine:
    """The bundled drafter A at k = 4 with the planted verifier `bug` (a key of `PLANTED`)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return SpecLoopEngine(target, drafter, verifier=PLANTED[bug], name=f"spec-loop-{bug}")


def residual_is_p(target: Target) -> SpecLoopEngine:
    """The recovered token drawn from p, not the residual, at every rejection."""
    return planted(target, "residual-is-p")


def residual_is_p_half(target: Target) -> SpecLoopEngine:
    """`residual_is_p` on half the rounds."""
    return planted(target, "residual-is-p-half")


def bonus_from_previous_slot(target: Target) -> SpecLoopEngine:
    """The bonus token drawn from p at slot k - 1."""
    return planted(target, "bonus-from-previous-slot")


def temperature_on_q_only(target: Target) -> SpecLoopEngine:
    """The verifier's p without the request's temperature (the drafter's q has it)."""
    return planted(target, "temperature-on-q-only")


def greedy_at_any_temperature(target: Target) -> SpecLoopEngine:
    """Greedy verification at every temperature: the engine returns the argmax path at T > 0."""
    return planted(target, "greedy-at-any-temperature")


class RawQReported(AutoregressiveDrafter):
    """Draws each draft from its processed q and reports its raw law as q, so the verifier accepts
    and recovers with the raw one: the q contract transformers #47932 broke in its DFlash, MTP and
    single-position candidate generators (a lossless round at T = 1 with nothing else processed)."""

    def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        token, _ = super().draw(logits, ctx)
        return token, torch.softmax(logits.double(), -1).to(logits.dtype)


class RawQDrawn(AutoregressiveDrafter):
    """Draws each draft from its raw law and reports its processed q: the other direction."""

    def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        from losscheck.core.sampling import sample

        q = ctx.process(logits)
        raw = torch.softmax(logits.double(), -1).to(logits.dtype)
        return (q.argmax(-1) if ctx.params.greedy else sample(raw, ctx.generator)), q


def _q_contract(target: Target, kind: type[AutoregressiveDrafter], name: str) -> SpecLoopEngine:
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return SpecLoopEngine(target, kind(honest.lm.model, name), name=f"spec-loop-{name}")


def q_raw_in_verify(target: Target) -> SpecLoopEngine:
    """Drafts from the processed q, verified with the raw one (`RawQReported`)."""
    return _q_contract(target, RawQReported, "q-raw-in-verify")


def q_raw_in_draft(target: Target) -> SpecLoopEngine:
    """Drafts from the raw law, verified with the processed q (`RawQDrawn`)."""
    return _q_contract(target, RawQDrawn, "q-raw-in-draft")


BIASED_ID, BIAS = 5, 6.0  # the bundled target's most frequent id at T = 1, and a bias that flips argmaxes


class BiasedArgmax(AutoregressiveDrafter):
    """Drafts the argmax of its logits with a bias added first, reporting that point mass as q: a
    lossless engine whose drafter does not draft the argmax of the model it gives losscheck."""

    def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        biased = logits.clone()
        biased[..., BIASED_ID] += BIAS
        token = biased.argmax(-1)
        return token, torch.nn.functional.one_hot(token, logits.shape[-1]).to(logits.dtype)


class DeclaresArgmax(SpecLoopEngine):
    """A `SpecLoopEngine` that gives its draft model as drafting the argmax (`law="greedy"`)."""

    def draft_model(self):
        from losscheck.engines import DraftModel

        model = super().draft_model()
        return None if model is None else DraftModel(model, "greedy")


def biased_argmax_drafts(target: Target) -> SpecLoopEngine:
    """Drafts argmax(logits + bias) while declaring argmax(logits) (`BiasedArgmax`): lossless, but
    its drafter-side claims rest on the wrong q and are withdrawn (`losscheck.cells.engine.draft_law`)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    drafter = BiasedArgmax(honest.lm.model, "biased-argmax")
    return DeclaresArgmax(target, drafter, name="spec-loop-biased-argmax")


def honest_argmax_drafts(target: Target) -> SpecLoopEngine:
    """Drafts argmax(logits) and declares it: the control for `biased_argmax_drafts`."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)

    class Argmax(AutoregressiveDrafter):
        def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
            token = logits.argmax(-1)
            return token, torch.nn.functional.one_hot(token, logits.shape[-1]).to(logits.dtype)

    return DeclaresArgmax(target, Argmax(honest.lm.model, "argmax"), name="spec-loop-argmax")


class HotterWhenSpeculating(SpecLoopEngine):
    """With speculation on, the whole request runs at 1.1·T: the output law is p at 1.1·T, the
    catalogue's `target_temperature_1.1` exactly (a law of p alone; the drafts are hotter too)."""

    def _generate(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        if request.speculative:
            hotter = dataclasses.replace(
                request.params, temperature=request.params.temperature * TARGET_TEMPERATURE_FACTOR
            )
            request = dataclasses.replace(request, params=hotter)
        return super()._generate(request)


def hotter_when_speculating(target: Target) -> SpecLoopEngine:
    """`target_temperature_1.1` planted on the speculative path (the bundled drafter A, k = 4)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return HotterWhenSpeculating(target, drafter, name="spec-loop-hotter")


def min_tokens_counted_in_rounds(target: Target) -> SpecLoopEngine:
    """Min tokens counted in rounds on the speculative path (SGLang PR #33643's min_new_tokens):
    EOS and the stop ids stay masked past `min_tokens` output tokens, so rows end later than the
    target says — each token drawn from a law the target gives too, so only where rows end shows it
    (`pit.stop_hazard`)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path
    from losscheck.selftest.history_bugs import PerRoundState

    drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
    engine = SpecLoopEngine(target, drafter, name="spec-loop-min-tokens-in-rounds")
    engine.spec.history = PerRoundState(counts_tokens=False, counts_rounds=True)
    return engine


def raw_logits_mtp() -> type:
    """transformers' MTP candidate generator with #47932's shape (the issue names it beside
    DFlash's): candidates drawn from the processed logits, each layer's raw logits (its projection
    through the LM head) returned as q."""
    from unittest import mock

    from transformers.generation.candidate_generator import MTPCandidateGenerator

    class RawLogitsMTP(MTPCandidateGenerator):
        def get_candidates(self, input_ids, *args, **kwargs):
            raw: list[torch.Tensor] = []
            project = self.mtp_model._project_to_logits

            def recording(hidden: torch.Tensor) -> torch.Tensor:
                logits = project(hidden)  # [B, n, V]
                raw.append(logits[:, -1:, :].detach().clone())  # the position each layer drafts from
                return logits

            with mock.patch.object(self.mtp_model, "_project_to_logits", recording):  # this instance's only
                ids, logits = super().get_candidates(input_ids, *args, **kwargs)
            return ids, (torch.cat(raw, dim=1).to(logits.device) if logits is not None and raw else logits)

    return RawLogitsMTP


def raw_logits_dflash() -> type:
    """transformers' DFlash candidate generator as #47932 shipped it: candidates drawn from the
    processed logits, the raw logits (the LM head's output) returned as q."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    class RawLogitsDFlash(DFlashTokenCandidateGenerator):
        def get_candidates(self, input_ids, *args, **kwargs):
            raw: list[torch.Tensor] = []
            hook = self.main_model_output_embeddings.register_forward_hook(
                lambda module, inputs, out: raw.append(out.detach().clone())
            )
            try:
                ids, logits = super().get_candidates(input_ids, *args, **kwargs)
            finally:
                hook.remove()
            return ids, (raw[-1].to(logits.device) if logits is not None and raw else logits)

    return RawLogitsDFlash


class DFlashRawQ(HFAssistedEngine):
    """`hf_dflash` with `raw_logits_dflash`'s generator in transformers' place for each call."""

    def _generate(self, request: GenerationRequest, logprobs: bool) -> HFAnswer:
        from unittest import mock

        with mock.patch("transformers.generation.utils.DFlashTokenCandidateGenerator", raw_logits_dflash()):
            return super()._generate(request, logprobs)


class MTPRawQ(HFAssistedEngine):
    """`hf_mtp` with `raw_logits_mtp`'s generator in transformers' place for each call."""

    def _generate(self, request: GenerationRequest, logprobs: bool) -> HFAnswer:
        from unittest import mock

        with mock.patch("transformers.generation.utils.MTPCandidateGenerator", raw_logits_mtp()):
            return super()._generate(request, logprobs)


def hf_mtp_q_raw_in_verify(target: Target) -> HFAssistedEngine:
    """The bundled MTP target drafting with its own MTP layer through `use_mtp`, #47932's bug
    planted: drafts drawn from the processed logits, accepted and recovered with the raw ones."""
    from losscheck.engines.hf import hf_mtp

    honest = hf_mtp(target)
    return MTPRawQ(honest.model, None, honest.k, honest.eos, name="hf-mtp-q-raw-in-verify", speculation="mtp")


def hf_dflash_q_raw_in_verify(target: Target) -> HFAssistedEngine:
    """The bundled DFlash checkpoint in transformers' assisted generation with #47932's bug planted:
    drafts drawn from the processed logits, accepted and recovered with the raw ones."""
    from losscheck.engines.hf import hf_dflash

    honest = hf_dflash(target)
    return DFlashRawQ(
        honest.model, honest.assistant, honest.k, honest.eos, name="hf-dflash-q-raw-in-verify", speculation="dflash"
    )
