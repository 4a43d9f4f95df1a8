"""Generation with a key/value cache through rank programs: transformers' StaticCache held as buffers
(`autotp.capture.kvcache`), a prefill and a decode step planned together (`autotp.decoding`) and run on 2 and 4
gloo ranks, gives the tokens of single-device ``generate``, greedy and sampled, and the prefill's logits."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotp import Plan
from autotp.capture.kvcache import CachedDecoder
from autotp.decoding import generate, parallelize_decoding, plan_decoding
from autotp.runtime import spawn
from conftest import weights_bound_profile

transformers = pytest.importorskip("transformers")

PROMPT, NEW_TOKENS = 4, 32
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}
CASES = {  # name -> (config, batch): Llama has 2 kv-heads, Mistral 1, both fewer than 4 devices
    "llama": (lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                               max_position_embeddings=64), 2),
    "mistral": (lambda: transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                                                   max_position_embeddings=64, sliding_window=None), 1),
}
# Megatron's split of every layer: heads (q, k, v by rows, o by columns) and the MLP
MEGATRON = {"self_attn.q_proj": "S(0)", "self_attn.k_proj": "S(0)", "self_attn.v_proj": "S(0)",
            "self_attn.o_proj": "S(1)", "mlp.gate_proj": "S(0)", "mlp.up_proj": "S(0)", "mlp.down_proj": "S(1)"}


def make(name: str):
    """The model, in eval mode, its prompts and their attention mask: the same on every call and so on every rank.
    Llama's first prompt is one token shorter than the second, left-padded as transformers takes a batch."""
    config, batch = CASES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).eval()
    prompt = torch.randint(1, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    if batch > 1:
        mask[0, 0] = prompt[0, 0] = 0
    return model, prompt, mask


def _logged(step, log: list):
    def run(*inputs):
        logits = step(*inputs)
        log.append(logits.detach())
        return logits
    return run


def _generate(rank, world, plans):
    out = {}
    for (name, kind), decoding in plans.items():
        model, prompt, mask = make(name)
        local = parallelize_decoding(model, decoding, rank=rank)
        prefill = []
        with torch.no_grad():
            greedy = generate(_logged(local.prefill, prefill), local.decode, prompt, model.generation_config,
                              attention_mask=mask, max_new_tokens=NEW_TOKENS)
            torch.manual_seed(7)
            sampled = local.generate(prompt, model.generation_config, attention_mask=mask,
                                     max_new_tokens=NEW_TOKENS, **SAMPLING)
        out[name, kind] = greedy.tolist(), sampled.tolist(), prefill[0].tolist()  # plain lists cross processes
    return out


def _plans(world: int, kinds: tuple) -> dict:
    plans = {}
    for name in CASES:
        model, prompt, _ = make(name)
        megatron = {f"model.layers.{i}.{m}.weight": (layout,) for i in range(2) for m, layout in MEGATRON.items()}
        for kind, pin in (("ilp", None), ("megatron", megatron)):
            if kind not in kinds:
                continue
            decoding = plans[name, kind] = plan_decoding(model, world, prompt.shape[0], PROMPT, PROMPT + NEW_TOKENS,
                                                         profile=weights_bound_profile(), pin=pin)
            for plan in (decoding.prefill, decoding.decode):
                assert any(p != "R" for n in plan.nodes.values() for p in n.out), (name, kind)  # really splits
                assert any(c["phase"] == "forward" for c in plan.collectives), (name, kind)
                assert not [op for op in plan.fallback_ops if op.startswith("index_copy")], (name, kind)
                for i, state in enumerate(("keys", "values")):  # each write takes the cache as laid out: in place
                    write = plan.nodes["index_copy__1" if i else "index_copy_"]
                    assert write.ins[0] == plan.nodes[f"cache_0_{state}"].out, (name, kind)
            # one copy of the weights and of the cache: the prefill takes the decode step's layouts
            assert decoding.prefill.parameters == decoding.decode.parameters, (name, kind)
            assert decoding.prefill.buffers == decoding.decode.buffers, (name, kind)
    return plans


def _reference(name: str):
    """Single-device ``generate``'s tokens, greedy and sampled, and the prefill's logits."""
    model, prompt, mask = make(name)
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        torch.manual_seed(7)
        sampled = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, **SAMPLING)
        step, prefill = CachedDecoder(model, prompt.shape[0], PROMPT + NEW_TOKENS), []
        ours = generate(_logged(step, prefill), step, prompt, model.generation_config, attention_mask=mask,
                        max_new_tokens=NEW_TOKENS)
        torch.manual_seed(7)
        ours_sampled = generate(step, step, prompt, model.generation_config, attention_mask=mask,
                                max_new_tokens=NEW_TOKENS, **SAMPLING)
    # the cached decoder is transformers' own decoding, padding and sampling included
    assert ours.tolist() == greedy.tolist() and ours_sampled.tolist() == sampled.tolist(), name
    return greedy.tolist(), sampled.tolist(), prefill[0]


# 2 ranks: Megatron's split (Llama's cache split by kv-head, Mistral's whole beside split heads); 4: the ILP's plans
@pytest.mark.parametrize("world, kinds", [(2, ("megatron",)), (4, ("ilp",))])
def test_generation_on_ranks_matches_single_device_generate(world, kinds):
    plans = _plans(world, kinds)
    if world == 2:  # Llama's 2 kv-heads: Megatron's cache is split by kv-head, written where the heads are made
        megatron = plans["llama", "megatron"].decode
        assert {megatron.buffers[f"cache_{i}_{s}"] for i in range(2) for s in ("keys", "values")} == {("S(1)",)}
        assert not {c["node"] for c in megatron.collectives} & {"index_copy_", "index_copy__1"}
    for kind in kinds:  # Mistral's one kv-head cannot be split (its positions or head dim may be)
        assert ("S(1)",) not in plans["mistral", kind].decode.buffers.values()
    reference = {name: _reference(name) for name in CASES}
    for rank, out in enumerate(spawn(_generate, world, plans)):
        for (name, kind), (greedy, sampled, prefill) in out.items():
            assert greedy == reference[name][0], (name, kind, rank)
            assert sampled == reference[name][1], (name, kind, rank)
            assert (torch.tensor(prefill) - reference[name][2]).abs().max().item() <= 1e-5, (name, kind, rank)


def test_a_prompt_of_another_length_than_planned_is_refused():
    model, prompt, _ = make("mistral")
    plans = plan_decoding(model, 2, 1, PROMPT, PROMPT + 4, profile=weights_bound_profile())
    with pytest.raises(Exception, match="planned for prompts of 4 tokens, not 3"):
        generate(object(), object(), prompt[:, :3], max_new_tokens=2, prompt_length=plans.prompt_length)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(None, object(), prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="give max_new_tokens"):
        generate(None, object(), prompt)
    with pytest.raises(Exception, match="do not fit a cache of 8 slots.*at most 5 new tokens"):
        generate(None, object(), prompt, max_new_tokens=6, max_length=8)
    with pytest.raises(Exception, match="below max_length"):
        plan_decoding(model, 2, 1, PROMPT, PROMPT)


def test_a_decode_step_on_slow_links_splits_less():
    """One row a step on links whose every message costs 10 ms: no collective pays for itself, so the decode step
    runs whole on each device; on the fast links of the other tests the same step splits (above)."""
    model, prompt, _ = make("llama")
    slow = weights_bound_profile()
    for link in slow["links"].values():
        link["latency_s"] = 1e-2
    fast = plan_decoding(model, 2, 1, PROMPT, PROMPT + 4, profile=weights_bound_profile())
    plans = plan_decoding(model, 2, 1, PROMPT, PROMPT + 4, profile=slow)
    assert fast.decode.forward_collectives()
    assert not plans.decode.forward_collectives() and not plans.prefill.forward_collectives()
    assert plans.decode.predicted["total_s"] < fast.decode.predicted["total_s"] + 1e-2  # not one message's worth


def test_the_serving_example_generates_the_tokens_of_generate():
    root = Path(__file__).parents[1]
    run = subprocess.run([sys.executable, str(root / "examples" / "serve.py")], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("the tokens of model.generate") == 2, run.stdout[-2000:]
    assert "decode: " in run.stdout and "ms predicted per token" in run.stdout


def test_the_cli_plans_generation_and_writes_both_plans(tmp_path, capsys):
    from autotp.cli import EXIT_USAGE, main

    out = tmp_path / "llama.json"
    assert main(["plan", "hf:llama", "--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "4",
                 "--vocab", "512", "--batch", "2", "--seq", "16", "--inference", "--decode", "64", "--mesh", "4",
                 "--json", str(out), "--quiet"]) == 0
    prefill, decode = (Plan.load(tmp_path / f"llama.{name}.json") for name in ("prefill", "decode"))
    assert prefill.inputs["args"][0]["shape"] == [2, 16] and decode.inputs["args"][0]["shape"] == [2, 1]
    assert prefill.parameters == decode.parameters and prefill.buffers == decode.buffers
    assert "ms predicted per token" in capsys.readouterr().out
    assert main(["plan", "hf:llama", "--layers", "2", "--decode", "64", "--mesh", "2", "--quiet"]) == EXIT_USAGE
    assert "--decode plans generation: give an hf: causal LM with --inference" in capsys.readouterr().err
    assert main(["plan", "hf:llama", "--layers", "2", "--inference", "--decode", "64", "--mesh", "2", "--svg", "x.svg",
                 "--quiet"]) == EXIT_USAGE
    assert "--svg cannot be combined with --decode" in capsys.readouterr().err
