"""Closed-form toy models for unit tests: Markov-table targets and drafters, tiny random HF LMs."""

from __future__ import annotations

import torch


def markov_table(vocab: int, generator: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    """A random next-token logit table [V, V]: row = previous token."""
    return torch.randn(vocab, vocab, generator=generator, dtype=torch.float64) * sharpness


def tiny_llama(vocab: int = 32, hidden: int = 32, layers: int = 2, seed: int = 0, max_positions: int = 128,
               eos: int = 1, scale: float = 8.0) -> torch.nn.Module:
    """A random-weight Llama whose logits are scaled up so greedy decoding has clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=0, eos_token_id=eos, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model
