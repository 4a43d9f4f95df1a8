"""Serving a transformers decoder with autotp: a prefill and a decode step planned together, generation on ranks.

Run: ``python examples/serve.py``. First the plans at scale: a Llama-2-70B
shaped decoder (4 of its 80 layers, on the meta device: nothing allocated)
on one 8-GPU node under ``h100-hgx``, its predicted prefill and per-token
times and where its key/value cache lives. Then the same code on this
machine: a small Llama with random weights planned for 2 CPU processes
(gloo), where the planner keeps it whole, and then with Megatron's split of
every layer pinned (its cache split by kv-head), which generates greedily
and by sampling on both from two prompts of different lengths (left-padded,
with their attention mask, as transformers batches them), every rank's
tokens checked against single-device ``model.generate``. Exits non-zero if
any differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from autotp import Mesh  # noqa: E402
from autotp.decoding import parallelize_decoding, plan_decoding  # noqa: E402
from autotp.runtime import spawn  # noqa: E402

PROMPT, NEW_TOKENS = 6, 16
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
MEGATRON = {f"model.layers.{i}.{m}.weight": (layout,) for i in range(2)  # heads and MLP split, as Megatron
            for m, layout in (("self_attn.q_proj", "S(0)"), ("self_attn.k_proj", "S(0)"), ("self_attn.v_proj", "S(0)"),
                              ("self_attn.o_proj", "S(1)"), ("mlp.gate_proj", "S(0)"), ("mlp.up_proj", "S(0)"),
                              ("mlp.down_proj", "S(1)"))}


def small_llama():
    """A 2-layer Llama with 4 heads and 2 kv-heads, and two prompts, the first 2 tokens shorter (left-padded),
    with their attention mask: the same on every rank (seeded)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    mask[0, :2] = prompts[0, :2] = 0  # padding (token 0 here) on the left, masked out
    return model, prompts, mask


def serve(rank, world, plans):
    """One rank: its prefill and decode programs, then greedy and sampled generation."""
    model, prompts, mask = small_llama()
    local = parallelize_decoding(model, plans, rank=rank)
    with torch.no_grad():
        greedy = local.generate(prompts, model.generation_config, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        torch.manual_seed(1234)  # the same seed on every rank: the same draws from the same logits
        sampled = local.generate(prompts, model.generation_config, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 **SAMPLING)
    return greedy.tolist(), sampled.tolist()


def main() -> int:
    import shapes

    model, _, _ = shapes.llama2_70b(layers=4, batch=1)
    print("Llama-2-70B-shaped (4 of 80 layers) on 8 H100 (h100-hgx), one prompt of 1024 tokens, 4096 positions:")
    print(plan_decoding(model, 8, 1, 1024, 4096, profile="h100-hgx").summary(), "\n")

    model, prompts, mask = small_llama()
    mesh = Mesh("2", links="loopback")  # processes on one machine, as the profile measured them
    shape = (model, mesh, prompts.shape[0], PROMPT, PROMPT + NEW_TOKENS)
    chosen = plan_decoding(*shape, profile="cpu-2core-4proc")
    print("a small Llama on 2 CPU processes, as the planner chooses (this machine's links are slow for a model "
          f"this small):\n{chosen.summary()}\n")
    plans = plan_decoding(*shape, profile="cpu-2core-4proc", pin=MEGATRON)
    print(f"and with Megatron's split of every layer pinned, run below:\n{plans.summary()}")
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        torch.manual_seed(1234)
        expected_sampled = model.generate(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                          **SAMPLING).tolist()
    ok = True
    for rank, (greedy, sampled) in enumerate(spawn(serve, 2, plans)):
        same = greedy == expected and sampled == expected_sampled
        ok &= same
        print(f"rank {rank}: greedy {greedy[0][PROMPT:]}..., sampled {sampled[0][PROMPT:]}..., "
              f"{'the tokens of model.generate' if same else 'DIFFERENT from model.generate'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
