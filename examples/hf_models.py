"""Small transformers models built from configs with random weights (nothing is downloaded).

``build(name)`` returns ``(model, args, kwargs)`` with the same weights and
inputs on every call, so every rank of a process group builds the same model.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 128, 8, 4


def _ids(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ, device=None):
    return torch.randint(0, vocab, (batch, seq), device=device)


def llama(vocab=VOCAB, heads=4, kv_heads=2, layers=2, hidden=64, dropout=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64, attention_dropout=dropout)
    ids = _ids(vocab)
    return LlamaForCausalLM(config), (ids,), {"labels": ids}


def mistral(vocab=VOCAB, heads=4, kv_heads=2, layers=2, hidden=64, dropout=0.0):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=64, sliding_window=SEQ, attention_dropout=dropout)
    ids = _ids(vocab)
    return MistralForCausalLM(config), (ids,), {"labels": ids}


def mixtral(vocab=VOCAB, heads=4, kv_heads=2, layers=2, hidden=64, experts=4, top_k=2, dropout=0.0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
                           attention_dropout=dropout)
    ids = _ids(vocab)
    return MixtralForCausalLM(config), (ids,), {"labels": ids}


def qwen2_moe(vocab=VOCAB, heads=4, kv_heads=2, layers=2, hidden=64, experts=4, top_k=2, dropout=0.0):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, shared_expert_intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
                            attention_dropout=dropout)
    ids = _ids(vocab)
    return Qwen2MoeForCausalLM(config), (ids,), {"labels": ids}


def falcon(vocab=VOCAB, heads=4, layers=2, hidden=64, dropout=0.0):
    """Falcon-7B's layout: one fused query_key_value weight, multi-query (one K/V head), rotary positions."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          multi_query=True, new_decoder_architecture=False, alibi=False, max_position_embeddings=64,
                          hidden_dropout=dropout, attention_dropout=dropout)
    ids = _ids(vocab)
    return FalconForCausalLM(config), (ids,), {"labels": ids}


def gpt2(vocab=VOCAB, heads=4, layers=2, hidden=64, dropout=0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    ids = _ids(vocab)
    return GPT2LMHeadModel(config), (ids,), {"labels": ids}


def bert(vocab=VOCAB, heads=4, layers=2, hidden=64, dropout=0.0):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    ids = _ids(vocab)
    return BertForMaskedLM(config), (ids,), {"labels": ids}


def vit(heads=4, layers=2, hidden=64, image=32, patch=8, batch=BATCH, dropout=0.0):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=image, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, intermediate_size=2 * hidden, num_labels=10,
                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    images = torch.randn(batch, 3, image, image)
    return ViTForImageClassification(config), (images,), {"labels": torch.arange(batch) % 10}


FAMILIES = {"llama": llama, "gpt2": gpt2, "bert": bert, "vit": vit}
MORE = {"mistral": mistral, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "falcon": falcon}  # built by `build`, not among the families
# every test runs


def build(name: str, train: bool = True, **overrides):
    """The named model in train or eval mode, with its example inputs (``dropout=p`` sets every dropout
    probability of its config, attention's included; 0 by default)."""
    torch.manual_seed(0)
    model, args, kwargs = {**FAMILIES, **MORE}[name](**overrides)
    model.train(train)
    return model, args, kwargs


LARGE = {  # shapes worth splitting across 4 GPUs; built on the meta device, never allocated
    "llama": dict(vocab=32000, heads=32, kv_heads=8, layers=2, hidden=4096),
    "gpt2": dict(vocab=50304, heads=16, layers=2, hidden=2048),
    "bert": dict(vocab=30720, heads=16, layers=2, hidden=1024),
    "vit": dict(heads=16, layers=2, hidden=1280, image=224, patch=14, batch=8),
}


SMALL = {  # replays of a LARGE plan need the same graph: Llama keeps grouped-query attention, K/V heads divisible by 4
    "llama": dict(heads=8, kv_heads=4),
}


def build_small(name: str, train: bool = True):
    """The small model a LARGE plan is replayed on, with its example inputs."""
    return build(name, train, **SMALL.get(name, {}))


def build_large(name: str):
    """The family at a size worth splitting, on the meta device, with meta example inputs."""
    with torch.device("meta"):
        model, args, kwargs = FAMILIES[name](**LARGE[name])
    to_meta = lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    return model, tuple(to_meta(a) for a in args), {k: to_meta(v) for k, v in kwargs.items()}
