"""Published model shapes on the meta device: planned without allocating a byte.

Each builder returns ``(model, args, kwargs)``. Weights live on ``meta``; the
token ids too. Batch is a parameter so that a data-parallel axis can split it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))


def _ids(vocab: int, batch: int, seq: int):
    return torch.randint(0, vocab, (batch, seq), device="meta")


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int, batch: int = 1,
          dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    ids = _ids(vocab, batch, seq)
    return model, (ids,), {"labels": ids}


def llama2_70b(layers: int = 80, seq: int = 4096, batch: int = 1):
    """Llama-2-70B: hidden 8192, GQA 64/8 heads, FFN 28672, vocab 32000."""
    return llama(layers, 8192, 64, 8, 28672, 32000, seq, batch)


def llama3_8b(layers: int = 32, seq: int = 4096, batch: int = 1):
    """Llama-3-8B: hidden 4096, GQA 32/8 heads, FFN 14336, vocab 128256."""
    return llama(layers, 4096, 32, 8, 14336, 128256, seq, batch)


def gpt3_175b(layers: int = 96, seq: int = 2048, batch: int = 1):
    """GPT-3 175B: 96 layers, hidden 12288, 96 heads, FFN 4x, vocab padded to 50304 (as Megatron does).

    Built from the project's GPT (examples/models.py: separate q/k/v, GELU MLP,
    tied nothing), in bf16.
    """
    from models import GPT

    with torch.device("meta"):
        model = GPT(vocab=50304, hidden=12288, heads=96, layers=layers, seq=seq).to(torch.bfloat16)
    ids = _ids(50304, batch, seq)
    return model, (ids, ids), {}


def mixtral_8x7b(layers: int = 32, seq: int = 4096, batch: int = 1, dtype=torch.bfloat16):
    """Mixtral-8x7B: hidden 4096, GQA 32/8 heads, 8 experts of FFN 14336 with 2 per token, vocab 32000."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=seq)
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(dtype)
    ids = _ids(32000, batch, seq)
    return model, (ids,), {"labels": ids}
