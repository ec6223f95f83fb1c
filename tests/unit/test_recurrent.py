"""The ragged cache with recurrent state (`losscheck.core.recurrent`): hybrid models of several
shipped architectures, built from tiny configs with random weights, rolled back per row after
every forward and compared with one full forward of the same tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from losscheck.core.ragged import forward_rows
from losscheck.core.recurrent import layer_kinds
from losscheck.core.target import HFTarget
from losscheck.errors import TargetError

transformers = pytest.importorskip("transformers")

V = 64


def _qwen3_next() -> object:
    return transformers.Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0, initializer_range=0.2,
    )  # fmt: skip


def _lfm2() -> object:
    return transformers.Lfm2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["conv", "full_attention", "conv"], initializer_range=0.2,
    )  # fmt: skip


def _nemotron_h() -> object:  # Mamba-2 mixers, attention and an MLP-only block (no cache at all)
    return transformers.NemotronHConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8,
    )  # fmt: skip


def _mamba2() -> object:  # recurrent layers only
    return transformers.Mamba2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
        chunk_size=8, expand=2,
    )  # fmt: skip


ARCHITECTURES: dict[str, Callable[[], object]] = {
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
    "mamba2": _mamba2,
}


def _target(name: str) -> HFTarget:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[name]())
    return HFTarget(model.eval(), name, {})


def _reference(target: HFTarget, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return target.model(input_ids=tokens).logits.float()  # [B, L, V]


def _rounds(
    target: HFTarget, tokens: torch.Tensor, prompt: torch.Tensor, roll_back: bool, expect: bool = False
) -> float:
    """Prefill ragged prompts (`expect`: announcing what each row keeps, so that only the states
    from the shortest prompt on are recorded), then score blocks of 5 and keep a random share of
    each, as the loop does; → the largest logit error against one forward of the whole sequences."""
    rows = len(prompt)
    reference = _reference(target, tokens)
    target.reset(rows, tokens.shape[1] + 8)
    if expect:
        target.expect(prompt)
    logits, _ = target.forward(tokens[:, : int(prompt.max())], torch.zeros(rows, dtype=torch.long))
    target.keep(prompt)
    error = max(float((logits[b, : prompt[b]] - reference[b, : prompt[b]]).abs().max()) for b in range(rows))
    lengths, rng = prompt.clone(), torch.Generator().manual_seed(1)
    for _ in range(5):
        block = torch.stack([tokens[b, lengths[b] : lengths[b] + 5] for b in range(rows)])
        logits, _ = target.forward(block, lengths)
        expect = torch.stack([reference[b, lengths[b] : lengths[b] + 5] for b in range(rows)])
        error = max(error, float((logits - expect).abs().max()))
        kept = torch.randint(0, 6, (rows,), generator=rng)  # 0: nothing of the block, 5: all of it
        if roll_back:
            target.keep(kept)
        lengths = lengths + kept
    return error


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_rolled_back_rows_match_one_forward(name: str) -> None:
    target = _target(name)
    assert target.stateful
    tokens = torch.randint(2, V, (3, 40), generator=torch.Generator().manual_seed(2))
    assert _rounds(target, tokens, torch.tensor([5, 9, 1]), roll_back=True) < 1e-4


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_prefill_recording_only_what_rows_keep_is_exact(name: str) -> None:
    target = _target(name)
    tokens = torch.randint(2, V, (3, 40), generator=torch.Generator().manual_seed(2))
    assert _rounds(target, tokens, torch.tensor([6, 9, 7]), roll_back=True, expect=True) < 1e-4
    target.reset(3, 16)
    target.expect(torch.tensor([6, 9, 7]))
    target.forward(tokens[:, :9], torch.zeros(3, dtype=torch.long))
    assert target.lm.cache.recorded == 4  # type: ignore[union-attr]  # states after tokens 6 .. 9 of 9


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_state_not_rolled_back_is_seen(name: str) -> None:
    """The comparison above can fail: skip `keep` and the rows' states hold rejected tokens (the
    random weights' logits move little with the state, but 100 times the exact error)."""
    target = _target(name)
    tokens = torch.randint(2, V, (3, 40), generator=torch.Generator().manual_seed(2))
    assert _rounds(target, tokens, torch.tensor([5, 9, 1]), roll_back=False) > 1e-2


def test_rows_prefilled_alone_keep_the_others() -> None:
    """A scheduler's admission (`forward_rows`) into a reused slot: the row starts from zeros, the
    other rows keep their states, and decoding on matches one forward."""
    target = _target("qwen3_next")
    tokens = torch.randint(2, V, (2, 30), generator=torch.Generator().manual_seed(3))
    reference = _reference(target, tokens)
    junk = torch.randint(2, V, (6,), generator=torch.Generator().manual_seed(4))  # row 1's previous request
    target.reset(2, 40)
    target.forward(torch.stack([tokens[0, :6], junk]), torch.zeros(2, dtype=torch.long))
    target.keep(torch.tensor([6, 6]))
    rows = torch.tensor([1])
    logits, _ = forward_rows(target.lm, rows, tokens[1:, :4], torch.zeros(1, dtype=torch.long))
    target.keep(torch.tensor([4]))
    assert float((logits[0] - reference[1, :4]).abs().max()) < 1e-4
    block = torch.stack([tokens[0, 6:9], tokens[1, 4:7]])
    logits, _ = target.forward(block, torch.tensor([6, 4]))
    assert float((logits[0] - reference[0, 6:9]).abs().max()) < 1e-4
    assert float((logits[1] - reference[1, 4:7]).abs().max()) < 1e-4


def test_repeated_prompts_share_one_prefill() -> None:
    """Rows that repeat a prompt are prefilled once (`RaggedLM._shared`) with their states copied."""
    target = _target("lfm2")
    prompt = torch.randint(2, V, (1, 12), generator=torch.Generator().manual_seed(5)).expand(3, -1)
    rest = torch.randint(2, V, (3, 30), generator=torch.Generator().manual_seed(6))
    assert _rounds(target, torch.cat([prompt, rest], 1), torch.tensor([12, 12, 12]), roll_back=True) < 1e-4


def test_unknown_layer_type_is_refused_by_name() -> None:
    config = _qwen3_next()
    config.layer_types = ["linear_attention", "indexed_attention", "linear_attention", "full_attention"]
    with pytest.raises(TargetError, match="layer 1 .*'indexed_attention'"):
        layer_kinds(config)


def test_attention_only_models_keep_the_kv_cache() -> None:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    assert layer_kinds(config) == ("attention", "attention")
    target = HFTarget(transformers.LlamaForCausalLM(config).eval(), "llama", {})
    assert not target.stateful


def test_hybrid_target_decodes_like_itself_with_drafts() -> None:
    """The loop end to end: a hybrid target with its own model drafting (state per row in both) and
    with a perturbed copy drafting (rejections every few tokens) emits exactly its plain greedy
    tokens, rows ragged, k = 1 and 4."""
    import copy

    from losscheck.core.engine import Engine
    from losscheck.core.sampling import SamplingParams
    from losscheck.drafters.autoregressive import AutoregressiveDrafter, self_draft

    target = _target("qwen3_next")
    model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    prompts = [[3, 9, 4, 17, 5], [8], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    greedy, rng = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
    plain = Engine(target).generate(prompts, 24, greedy, rng).tokens
    for drafter in (self_draft(target), AutoregressiveDrafter(model, "noisy")):
        for k in (1, 4):
            out = Engine(target, drafter, k=k).generate(prompts, 24, greedy, rng)
            assert torch.equal(out.tokens, plain), (drafter.name, k)
            accepted, proposed = int(out.stats.accepted.sum()), int(out.stats.proposed.sum())
            if drafter.name == "self-draft":
                assert accepted == proposed  # the oracle: every draft accepted
            else:
                assert 0 < accepted < proposed  # rejections, so rollbacks, happened


def test_teacher_forcing_rolls_the_padded_prompts_back() -> None:
    """The scorer's fresh pass prefills prompts of different lengths padded to one width, then reads
    each row from its own last prompt token: a row's recurrent state must leave the padding."""
    from losscheck.cells.scoring import teacher_forced_probs
    from losscheck.core.sampling import SamplingParams

    target = _target("qwen3_next")
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    tokens = torch.tensor([[20, 21, 22], [30, 31, 32]])
    forced = teacher_forced_probs(target, rows, tokens, SamplingParams(temperature=1.0))
    for b, prompt in enumerate(rows):
        whole = torch.tensor([prompt + tokens[b].tolist()])
        expect = _reference(target, whole)[0, len(prompt) - 1 : -1].softmax(-1)  # [3, V]
        assert float((forced.probs[b] - expect).abs().max()) < 1e-5
