"""Generation on the clock: autotp's prefill and decode programs against one process and DTensor with HF's tp_plan.

    python benchmarks/decode_runtime.py [--families llama,gemma2,...] [--worlds 2,4] [--batches 1,8]
                                        [--layers 4 --hidden 512] [--prompt 64] [--new 32] [--rounds 5]
                                        [--warmup 1] [--quick]

A transformers causal LM of each family in ``--families`` (`FAMILIES`:
Llama, Mistral and Gemma-2 with a sliding window of half the prompt,
GPT-2, BLOOM, Falcon and OPT; random weights, fp32, eval mode) generates ``--new`` tokens greedily after prompts of ``--prompt`` tokens
(the first row of a batch left-padded to half its length, as transformers
batches prompts of different lengths), through transformers' ``StaticCache``
of prompt + new slots, several ways, for each number of gloo processes in
``--worlds`` and each batch in ``--batches``:

- ``autotp (cpu-2core-4proc)``: `autotp.decoding.plan_decoding` free,
  under the shipped profile, on ``Mesh(W, links="loopback")``, run by
  `autotp.decoding.parallelize_decoding`;
- ``autotp, HF tp_plan pinned``: the same with the model's own Hugging Face
  ``tp_plan`` pinned (`autotp.interop.hf_tp_plan_pins`): DTensor's split,
  autotp's programs;
- ``DTensor + HF tp_plan``: ``parallelize_module`` with the styles of the
  model's ``tp_plan`` (`runtime.hf_tp_parallelize`), the cache allocated at
  its first write with each rank's heads (transformers' lazy
  initialisation, as it serves a tp_plan). These two only for the families
  whose config has a ``tp_plan`` (Llama, Mistral, Gemma-2);
- ``one process``: the eager model with its cache (`CachedDecoder`, which
  is transformers' forward with a ``StaticCache``), in one process using
  every core (run on its own, after the others), and beside it ``autotp,
  mesh of 1``: the rank programs of plans for one device.

Every way runs the same loop (`autotp.decoding.generate`), which times each
step call: the prefill once a round, each decode step once per new token
after the first. The multi-process ways run interleaved, a round each in
turn, each call after a barrier, and a call's time is the slowest rank's.
The table gives medians over ``--rounds`` rounds after ``--warmup``, the
collectives each step issues (counted in a last round: autotp's
`CommCounter`, DTensor's functional collectives through a dispatch mode),
and the plans' predictions. Every way must give the one process's tokens,
or the script exits with status 1.

``--quick`` checks that the script runs, as tests/test_benchmarks.py does:
2 processes, batch 2, one layer of hidden 128, a prompt of 8 and 4 new
tokens, one round; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autotp
from autotp.capture.kvcache import CachedDecoder, cache_argument
from autotp.decoding import generate, parallelize_decoding, plan_decoding, reset_cache
from autotp.interop import hf_tp_plan_pins
from autotp.lower.collectives import CommCounter
from autotp.runtime import spawn
from runtime import VOCAB, FunctionalCollectiveBytes, build, hf_tp_parallelize

PROFILE = "cpu-2core-4proc"
ONE = ("one process", "autotp, mesh of 1")
BASELINES = ("one process", "DTensor + HF tp_plan")
QUICK = dict(worlds="2", batches="2", layers=1, hidden=128, prompt=8, new=4, rounds=1, warmup=0)


def _config(family: str, layers: int, hidden: int, positions: int, window: int):
    """A config of ``family`` with heads of 64 (as many kv-heads), ``window`` the sliding window where it has one."""
    import transformers

    heads, inner = hidden // 64, int(hidden * 2.6875) // 64 * 64
    llama = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=positions)
    return {
        "llama": lambda: transformers.LlamaConfig(**llama),
        "mistral": lambda: transformers.MistralConfig(**llama, sliding_window=window),
        "gemma2": lambda: transformers.Gemma2Config(**llama, head_dim=64, sliding_window=window),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                                n_positions=positions, bos_token_id=0, eos_token_id=0),
        "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=hidden, n_layer=layers,
                                                  n_head=heads),
        "falcon": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                                    num_attention_heads=heads),
        "opt": lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=hidden, ffn_dim=inner,
                                              num_hidden_layers=layers, num_attention_heads=heads,
                                              max_position_embeddings=positions, word_embed_proj_dim=hidden),
    }[family]()


FAMILIES = ("llama", "mistral", "gemma2", "gpt2", "bloom", "falcon", "opt")


def model_and_prompts(layers: int, hidden: int, batch: int, prompt: int, new: int, family: str = "llama"):
    """The model (the same weights on every call, and so on every rank), the prompts and their attention mask."""
    if family == "llama":
        model = build(layers, hidden, prompt + new)[0].eval()
    else:
        import transformers

        torch.manual_seed(0)
        config = _config(family, layers, hidden, prompt + new, max(2, prompt // 2))
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :prompt // 2] = ids[0, :prompt // 2] = 0  # a prompt half as long, left-padded
    return model, ids, mask


class Timed:
    """A step that records how long each call takes (after a barrier among the ranks, where there are several),
    and how many collectives it issues."""

    def __init__(self, step, counter: CommCounter, barrier: bool):
        self.step, self.counter, self.barrier = step, counter, barrier
        self.times, self.counts = [], []

    def __call__(self, *inputs):
        if self.barrier:
            dist.barrier()
        before = self.counter.count
        started = time.perf_counter()
        out = self.step(*inputs)
        self.times.append(time.perf_counter() - started)
        self.counts.append(self.counter.count - before)
        return out


class Way:
    """One way to generate: its two steps, how its cache is emptied, how it counts collectives."""

    def __init__(self, name, prefill, decode, reset, counter=None, mode=None):
        self.name, self.prefill, self.decode, self.reset = name, prefill, decode, reset
        self.counter, self.mode = counter or CommCounter(), mode
        self.prefill_s, self.decode_s, self.counts, self.tokens = [], [], (0, 0), None

    def round(self, ids, mask, new: int, barrier: bool, counting: bool = False) -> None:
        self.reset()
        prefill, decode = (Timed(s, self.counter, barrier) for s in (self.prefill, self.decode))
        with torch.no_grad(), (self.mode if counting and self.mode is not None else contextlib.nullcontext()):
            tokens = generate(prefill, decode, ids, attention_mask=mask, max_new_tokens=new,
                              max_length=ids.shape[1] + new, do_sample=False)
        if counting:
            self.counts, self.tokens = (prefill.counts[0], decode.counts[0]), tokens.tolist()
        else:
            self.prefill_s.append(prefill.times[0])
            self.decode_s.append(decode.times)


def _autotp(name, model, plans, rank):
    counter = CommCounter()
    local = parallelize_decoding(model, plans, rank=rank, counter=counter)
    return Way(name, local.prefill, local.decode, lambda: reset_cache(local.prefill, local.decode), counter)


def _dtensor(model, world, max_length):
    from transformers import StaticCache

    hf_tp_parallelize(model, world)
    cache = StaticCache(config=model.config, max_cache_len=max_length)  # allocated at its first write: local heads
    argument = cache_argument(model)

    def step(ids, slots, mask, positions):
        return model(input_ids=ids, cache_position=slots, attention_mask=mask, position_ids=positions,
                     use_cache=True, logits_to_keep=1, **{argument: cache}).logits

    counter = CommCounter()
    return Way("DTensor + HF tp_plan", step, step, cache.reset, counter, FunctionalCollectiveBytes(counter))


def measure(ways, ids, mask, new: int, rounds: int, warmup: int, barrier: bool) -> dict:
    for _ in range(warmup):
        for way in ways:
            way.round(ids, mask, new, barrier)
    for _ in range(rounds):
        for way in ways:  # interleaved: ABC ABC ...
            way.round(ids, mask, new, barrier)
    for way in ways:
        way.round(ids, mask, new, barrier, counting=True)
    return {w.name: {"prefill": w.prefill_s, "decode": w.decode_s, "counts": w.counts, "tokens": w.tokens}
            for w in ways}


def has_tp_plan(model) -> bool:
    """Whether the model's config carries Hugging Face's own tensor-parallel plan."""
    return bool(getattr(model.config, "base_model_tp_plan", None))


def _run_parallel(rank, world, plans, sizes, rounds, warmup):
    prompt, new = sizes[3:5]
    ways = []
    for name, decoding in plans.items():
        model, ids, mask = model_and_prompts(*sizes)
        ways.append(_autotp(name, model, decoding, rank))
    model = model_and_prompts(*sizes)[0]
    if has_tp_plan(model):
        ways.append(_dtensor(model, world, prompt + new))
    return measure(ways, ids, mask, new, rounds, warmup, barrier=True)


def _run_single(rank, world, one, sizes, rounds, warmup):
    model, ids, mask = model_and_prompts(*sizes)
    step = CachedDecoder(model, ids.shape[0], ids.shape[1] + sizes[4])
    ways = [Way("one process", step, step, lambda: reset_cache(step)),
            _autotp("autotp, mesh of 1", model_and_prompts(*sizes)[0], one, rank)]
    return measure(ways, ids, mask, sizes[4], rounds, warmup, barrier=False)


def slowest(per_rank: list[dict], way: str) -> tuple[float, float]:
    """The medians of the prefill's and of a decode step's time, each call's time the slowest rank's."""
    prefill = [max(r[way]["prefill"][i] for r in per_rank) for i in range(len(per_rank[0][way]["prefill"]))]
    steps = [max(r[way]["decode"][i][j] for r in per_rank)
             for i in range(len(per_rank[0][way]["decode"])) for j in range(len(per_rank[0][way]["decode"][i]))]
    return statistics.median(prefill), statistics.median(steps)


def report(family: str, world: int, batch: int, per_rank: list[dict], single: list[dict], plans: dict) -> bool:
    rows = {w: (per_rank, slowest(per_rank, w)) for w in per_rank[0]} | {w: (single, slowest(single, w))
                                                                       for w in single[0]}
    best = min(rows[w][1][1] for w in BASELINES if w in rows)
    expected = single[0]["one process"]["tokens"]
    print(f"\n### {family}, {world} gloo processes, batch {batch}\n")
    print("| way | prefill (ms, median) | per token (ms, median) | per token × best of one process, DTensor | "
          "predicted prefill (ms) | predicted per token (ms) | collectives: prefill, per token | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    same = True
    for way, (ranks, (prefill, token)) in rows.items():
        plan = plans.get(way)
        predicted = (f"{plan.prefill.predicted['total_s'] * 1e3:.2f} | {plan.decode.predicted['total_s'] * 1e3:.3f}"
                     if plan else " | ")
        agree = all(r[way]["tokens"] == expected for r in ranks)
        same &= agree
        print(f"| {way} | {prefill * 1e3:.2f} | {token * 1e3:.3f} | {token / best:.2f} | {predicted} | "
              f"{ranks[0][way]['counts'][0]}, {ranks[0][way]['counts'][1]} | "
              f"{'as one process' if agree else 'DIFFERENT'} |")
    for way, plan in plans.items():
        if way not in ONE:
            split = sum(1 for layout in plan.decode.parameters.values() if any(p != "R" for p in layout))
            print(f"\n{way}: {split} of {len(plan.decode.parameters)} parameters split; {plan.summary()}")
    return same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="llama", help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32, help="tokens generated after each prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: does the script run? (overrides the rest)")
    opts = parser.parse_args(argv)
    if opts.quick:
        vars(opts).update(QUICK)
    started = time.perf_counter()
    print(f"{opts.families}: {opts.layers} layers x {opts.hidden}, vocabulary {VOCAB}, prompts of {opts.prompt} tokens, "
          f"{opts.new} new; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    same = True
    for family, world, batch in ((f, int(w), int(b)) for f in opts.families.split(",")
                                 for w in opts.worlds.split(",") for b in opts.batches.split(",")):
        sizes = (opts.layers, opts.hidden, batch, opts.prompt, opts.new, family)
        model = model_and_prompts(*sizes)[0]
        shape = (model, autotp.Mesh(str(world), links="loopback"), batch, opts.prompt, opts.prompt + opts.new)
        plans = {f"autotp ({PROFILE})": plan_decoding(*shape, profile=PROFILE)}
        if has_tp_plan(model):
            plans["autotp, HF tp_plan pinned"] = plan_decoding(*shape, profile=PROFILE, pin=hf_tp_plan_pins(model))
        per_rank = spawn(_run_parallel, world, plans, sizes, opts.rounds, opts.warmup, timeout_s=3600)
        one = plan_decoding(model, autotp.Mesh("1", links="loopback"), *shape[2:], profile=PROFILE)
        single = spawn(_run_single, 1, one, sizes, opts.rounds, opts.warmup, timeout_s=3600)
        same &= report(family, world, batch, per_rank, single, plans | {"autotp, mesh of 1": one})
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
