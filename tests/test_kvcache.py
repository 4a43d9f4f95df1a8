"""Decoding with a key/value cache through rank modules: transformers' StaticCache held as buffers
(`autotp.capture.kvcache`), captured, planned and run on 2 gloo ranks, gives the tokens of single-device
``generate`` and its logits."""

import pytest
import torch

import autotp
from autotp.capture.kvcache import CachedDecoder, greedy
from autotp.runtime import spawn
from conftest import weights_bound_profile

transformers = pytest.importorskip("transformers")

NEW_TOKENS, CACHE = 8, 16
CASES = {  # name -> (config, batch): Mistral has one kv-head for two devices
    "llama": (lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                               max_position_embeddings=64), 2),
    "mistral": (lambda: transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                                                   max_position_embeddings=64, sliding_window=None), 1),
}


def make(name: str):
    """The model, in eval mode, and its prompts: the same on every call and so on every rank."""
    config, batch = CASES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).eval()
    prompt = torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(1))
    return model, prompt


def _logged(step, log: list):
    def run(ids, position):
        logits = step(ids, position)
        log.append(logits.detach())
        return logits
    return run


# Megatron's split of every layer: heads (q, k, v by rows, o by columns) and the MLP; the whole cache then takes
# the keys and values gathered
MEGATRON = {"self_attn.q_proj": "S(0)", "self_attn.k_proj": "S(0)", "self_attn.v_proj": "S(0)",
            "self_attn.o_proj": "S(1)", "mlp.gate_proj": "S(0)", "mlp.up_proj": "S(0)", "mlp.down_proj": "S(1)"}


def _decode(rank, world, plans):
    out = {}
    for (name, kind), plan in plans.items():
        model, prompt = make(name)
        local = autotp.parallelize(CachedDecoder(model, prompt.shape[0], CACHE), plan, rank=rank)
        logits = []
        with torch.no_grad():
            tokens = greedy(_logged(local, logits), prompt, NEW_TOKENS)
        out[name, kind] = tokens.tolist(), torch.cat(logits, 1).tolist()  # plain lists cross the process boundary
    return out


def test_greedy_decoding_with_a_static_cache_on_two_ranks_matches_generate():
    plans, reference = {}, {}
    for name in CASES:
        model, prompt = make(name)
        with torch.no_grad():
            expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[:, prompt.shape[1]:]
            logits = []
            tokens = greedy(_logged(CachedDecoder(model, prompt.shape[0], CACHE), logits), prompt, NEW_TOKENS)
        assert tokens.tolist() == expected.tolist(), name  # the cached decoder is transformers' own decoding
        reference[name] = tokens.tolist(), torch.cat(logits, 1)
        step_inputs = (prompt[:, :1], torch.tensor([0]))
        megatron = {f"model.model.layers.{i}.{m}.weight": (layout,) for i in range(2) for m, layout in MEGATRON.items()}
        for kind, pin in (("ilp", None), ("megatron", megatron)):
            plan = plans[name, kind] = autotp.plan(CachedDecoder(make(name)[0], prompt.shape[0], CACHE), 2,
                                                   step_inputs, training=False, whole_outputs=True,
                                                   profile=weights_bound_profile(), pin=pin)
            assert any(p != "R" for n in plan.nodes.values() for p in n.out), (name, kind)  # the step really splits
            assert any(c["phase"] == "forward" for c in plan.collectives), (name, kind)
            assert not [op for op in plan.fallback_ops if op.startswith("index_copy")], (name, kind)  # understood
            for i in range(2):  # each write takes the cache as it is laid out: in place, never a copy
                assert plan.nodes[f"index_copy__{i}" if i else "index_copy_"].ins[0] == plan.nodes[f"cache_0_{('keys', 'values')[i]}"].out
        assert plans[name, "megatron"].parameters["model.model.layers.1.self_attn.k_proj.weight"] == ("S(0)",)
    # Llama's cache is split by kv-head as its keys and values are made, and written where they are: nothing moves
    megatron = plans["llama", "megatron"]
    assert {megatron.nodes[f"cache_{i}_{s}"].out for i in range(2) for s in ("keys", "values")} == {("S(1)",)}
    assert not {c["node"] for c in megatron.collectives} & {"index_copy_", "index_copy__1", "index_copy__2"}
    # Mistral's one kv-head cannot be split over two devices: its cache stays whole
    assert plans["mistral", "megatron"].nodes["cache_0_keys"].out == ("R",)
    for rank, out in enumerate(spawn(_decode, 2, plans)):
        for (name, kind), (tokens, logits) in out.items():
            assert tokens == reference[name][0], (name, kind, rank)
            assert (torch.tensor(logits) - reference[name][1]).abs().max().item() <= 1e-5, (name, kind, rank)
