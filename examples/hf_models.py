"""Small transformers models built from configs with random weights (nothing is downloaded).

``build(name)`` returns ``(model, args, kwargs)`` with the same weights and
inputs on every call, so every rank of a process group builds the same model.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 128, 8, 4


def _ids(vocab: int = VOCAB):
    return torch.randint(0, vocab, (BATCH, SEQ))


def llama(vocab=VOCAB, heads=4, kv_heads=2, layers=2, hidden=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64, attention_dropout=0.0)
    ids = _ids(vocab)
    return LlamaForCausalLM(config), (ids,), {"labels": ids}


def gpt2(vocab=VOCAB, heads=4, layers=2, hidden=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = _ids(vocab)
    return GPT2LMHeadModel(config), (ids,), {"labels": ids}


def bert(vocab=VOCAB, heads=4, layers=2, hidden=64):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = _ids(vocab)
    return BertForMaskedLM(config), (ids,), {"labels": ids}


def vit(heads=4, layers=2, hidden=64):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, intermediate_size=2 * hidden, num_labels=10,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config), (torch.randn(BATCH, 3, 32, 32),), {"labels": torch.arange(BATCH)}


FAMILIES = {"llama": llama, "gpt2": gpt2, "bert": bert, "vit": vit}


def build(name: str, train: bool = True, **overrides):
    """The named model in train (dropout is 0) or eval mode, with its example inputs."""
    torch.manual_seed(0)
    model, args, kwargs = FAMILIES[name](**overrides)
    model.train(train)
    return model, args, kwargs
