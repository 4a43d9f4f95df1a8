"""Generation on every family of causal LM, on split plans: sliding-window and hybrid caches (Gemma-2 and 3, a
Mistral whose window is shorter than the generation), configs that name their heads their own way (GPT-2, BLOOM,
OPT, Falcon's multi-query attention), learned positions (GPT-2, OPT) and ALiBi (BLOOM). Each rank's tokens equal
single-device ``model.generate``'s, greedy and sampled, twice in a row on the same rank programs (the second run
starts from a cache the first filled: `autotp.decoding.reset_cache` must empty all of it)."""

import pytest
import torch

from autotp.capture.kvcache import CachedDecoder
from autotp.decoding import generate, parallelize_decoding, plan_decoding
from autotp.errors import PlanError
from autotp.runtime import spawn
from conftest import weights_bound_profile

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW_TOKENS, WINDOW = 128, 5, 12, 4  # 17 positions: past the window of 4
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}
SMALL = {"vocab_size": VOCAB}
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                sliding_window=WINDOW, max_position_embeddings=64, **SMALL),
    "gemma3": lambda: transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                    sliding_window=WINDOW, max_position_embeddings=64, **SMALL),
    "mistral": lambda: transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  sliding_window=WINDOW, max_position_embeddings=64, **SMALL),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                            eos_token_id=0, **SMALL),
    "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **SMALL),
    "falcon": lambda: transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                **SMALL),  # multi-query: one kv-head
    "opt": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=64, word_embed_proj_dim=64, **SMALL),
}
# mesh -> batch: on 2 devices one prompt under a memory limit below the whole weights, so the weights split;
# on 2x2 two prompts, the first left-padded, planned freely (the cache splits by rows and heads)
MESHES = {"2": 1, "2x2": 2}


def make(name: str, batch: int):
    """The model in eval mode, its prompts and their mask: the same on every call and so on every rank."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    prompt = torch.randint(1, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    if batch > 1:
        mask[0, 0] = prompt[0, 0] = 0
    return model, prompt, mask


def _twice(step_generate, model, prompt, mask) -> list:
    """Greedy, then sampled from seed 7, then both again: four token lists."""
    runs = []
    with torch.no_grad():
        for _ in range(2):
            runs.append(step_generate(prompt, model.generation_config, attention_mask=mask,
                                      max_new_tokens=NEW_TOKENS).tolist())
            torch.manual_seed(7)
            runs.append(step_generate(prompt, model.generation_config, attention_mask=mask,
                                      max_new_tokens=NEW_TOKENS, **SAMPLING).tolist())
    return runs


def _reference(name: str, batch: int) -> list:
    """``model.generate``'s greedy and sampled tokens; the single-device `CachedDecoder` gives them twice too."""
    model, prompt, mask = make(name, batch)
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        torch.manual_seed(7)
        sampled = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, **SAMPLING).tolist()
    step = CachedDecoder(model, batch, PROMPT + NEW_TOKENS)
    ours = _twice(lambda *a, **k: generate(step, step, *a, **k), model, prompt, mask)
    assert ours == [greedy, sampled] * 2, name
    return [greedy, sampled] * 2


def _plans(mesh: str, batch: int) -> dict:
    plans = {}
    for name in CONFIGS:
        model, _, _ = make(name, batch)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        limit = int(0.75 * weights) if batch == 1 else None
        plans[name] = decoding = plan_decoding(model, mesh, batch, PROMPT, PROMPT + NEW_TOKENS,
                                               profile=weights_bound_profile(), memory_limit=limit)
        for plan in (decoding.prefill, decoding.decode):
            if limit is not None:  # a plan that splits no weight would prove nothing of the split weights
                assert any(p != "R" for layout in plan.parameters.values() for p in layout), (name, mesh)
            else:
                assert any(p != "R" for layout in plan.buffers.values() for p in layout), (name, mesh)
    return plans


def _rank_tokens(rank, world, plans, batch):
    out = {}
    for name, decoding in plans.items():
        model, prompt, mask = make(name, batch)
        local = parallelize_decoding(model, decoding, rank=rank)
        out[name] = _twice(local.generate, model, prompt, mask)
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_family_generates_the_tokens_of_generate_twice(mesh):
    batch = MESHES[mesh]
    plans = _plans(mesh, batch)
    reference = {name: _reference(name, batch) for name in CONFIGS}
    world = 4 if "x" in mesh else int(mesh)
    for rank, out in enumerate(spawn(_rank_tokens, world, plans, batch)):
        for name, runs in out.items():
            assert runs == reference[name], (name, mesh, rank)


def test_a_model_that_cannot_generate_is_refused_by_name():
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64))
    with pytest.raises(PlanError, match="BertModel does not generate"):
        plan_decoding(bert, 2, 1, PROMPT, PROMPT + NEW_TOKENS)
    with pytest.raises(PlanError, match="Linear does not generate"):
        CachedDecoder(torch.nn.Linear(4, 4), 1, 8)
