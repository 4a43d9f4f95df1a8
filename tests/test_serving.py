"""Serving-shaped plans (`autotp.serving`): the devices a replica spans and the batch the memory allows, chosen for
latency or throughput; the chosen plans run on 4 gloo ranks as replicas, each generating its own prompts' tokens
exactly as ``model.generate`` does."""

import pytest
import torch

import autotp

from autotp.decoding import plan_decoding
from autotp.errors import MemoryLimitError, PlanError
from autotp.runtime import spawn
from autotp.serving import parallelize_serving, plan_serving, replica_meshes
from conftest import weights_bound_profile

transformers = pytest.importorskip("transformers")

PROMPT, MAX_LENGTH, NEW_TOKENS, VOCAB = 4, 16, 8, 128


def make():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prompts(replica: int, batch: int) -> torch.Tensor:
    """Each replica's own requests."""
    return torch.randint(1, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(100 + replica))


def _limit(model) -> int:
    """Room for the weights and a few rows of cache beside them: the batch is the memory's to choose."""
    return int(1.6 * sum(p.numel() * p.element_size() for p in model.parameters()))


@pytest.fixture(scope="module")
def serving():
    model = make()
    options = {"profile": weights_bound_profile(), "memory_limit": _limit(model), "max_batch": 64}
    return {target: plan_serving(model, "4", PROMPT, MAX_LENGTH, target=target, **options)
            for target in ("latency", "throughput")}


def test_latency_takes_every_device_and_throughput_takes_replicas_at_the_largest_batch(serving):
    latency, throughput = serving["latency"], serving["throughput"]
    assert (latency.chosen.devices, latency.chosen.batch) == (4, 1)
    assert latency.chosen.latency_s == min(o.latency_s for o in latency.options if o.plans is not None)
    best = throughput.chosen
    assert best.devices < 4 and best.replicas == 4 // best.devices and best.batch > 1
    assert best.tokens_per_s == max(o.tokens_per_s for o in throughput.options if o.plans is not None)
    new = MAX_LENGTH - PROMPT  # each row's new tokens, after its prefill, over the replica's devices
    step_s = best.plans.prefill.predicted["total_s"] + new * best.plans.decode.predicted["total_s"]
    assert best.tokens_per_s == pytest.approx(best.batch * new / (step_s * best.devices))
    assert best.latency_s == best.plans.decode.predicted["total_s"]
    for option in throughput.options:  # every batch planned fits
        assert option.plans is not None and option.memory_bytes <= _limit(make())
    with pytest.raises(MemoryLimitError):  # and one row more than the chosen batch does not
        plan_decoding(make(), best.mesh, best.batch + 1, PROMPT, MAX_LENGTH, profile=weights_bound_profile(),
                      memory_limit=_limit(make()))
    assert "-> " in throughput.summary() and "tokens/s/device" in throughput.summary()


def _serve(rank, world, serving):
    model = make()
    replica, local = parallelize_serving(model, serving, rank)
    with torch.no_grad():
        tokens = local.generate(prompts(replica, serving.chosen.batch), model.generation_config,
                                max_new_tokens=NEW_TOKENS)
    return replica, tokens.tolist()


@pytest.mark.parametrize("target", ["latency", "throughput"])
def test_each_replica_generates_the_tokens_of_generate(serving, target):
    chosen = serving[target].chosen
    model = make()
    seen = set()
    for replica, tokens in spawn(_serve, 4, serving[target]):
        with torch.no_grad():
            expected = model.generate(prompts(replica, chosen.batch), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == expected.tolist(), (target, replica)
        seen.add(replica)
    assert seen == set(range(chosen.replicas))


def test_replica_meshes_and_bad_targets():
    subs = replica_meshes(autotp.Mesh("2x4", names=("node", "gpu"), links="infiniband,nvlink"))
    assert [m.size for m in subs] == [8, 4, 2, 1]
    assert [(m.names, m.links) for m in subs[1:]] == [(("gpu",), ("nvlink",))] * 3  # the inner axis's
    model = make()
    with pytest.raises(PlanError, match="unknown serving target 'speed'"):
        plan_serving(model, "2", PROMPT, MAX_LENGTH, target="speed")
    for target in ("latency", "throughput"):  # a latency bound holds for either target
        with pytest.raises(PlanError, match="no option decodes a token within 0.000 ms: the fastest is"):
            plan_serving(model, "2", PROMPT, MAX_LENGTH, target=target, latency_s=1e-9,
                         profile=weights_bound_profile(), max_batch=2)
