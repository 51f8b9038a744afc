"""transformers' common model and generation tests, in their ideas, on the project's tiny models.

transformers' ``ModelTesterMixin`` and ``GenerationTesterMixin`` live in its repository's ``tests/`` folder,
which the installed package does not ship; ``test_transformers_mixins.py`` runs them, when fetched, on FoX
(Pro) and the Transformer (LLaMA). The checks an in-library causal LM gets from them are also written here,
one test per idea, named after the mixins' tests, and run with no download on a tiny FoX (Pro and LLaMA),
both Transformers and the recurrent baselines. Skipped, each with its reason: what
needs a GPU or the Hub, and what an architecture cannot have (attention weights of a recurrence, keys and
values in a fixed-size recurrent state).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig

from fox_models.cache import FoxCacheLayer
from fox_models.compat import GenerationMixin, GradientCheckpointingLayer, output_cache
from fox_models.presets import get_preset

VOCAB, BATCH, SEQ = 99, 3, 7
# The models and their inputs stay on the CPU, also on a machine with a GPU (transformers' testing device
# would move the models to CUDA and leave the inputs here); the GPU paths have `gpu` tests of their own.
DEVICE = "cpu"
FAMILIES = {
    "fox-pro": dict(hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2),
    "fox-llama": dict(hidden_size=32, num_hidden_layers=2, num_heads=4),
    "transformer-pro": dict(hidden_size=32, num_hidden_layers=2, num_heads=4),
    "transformer-llama": dict(hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2),
    "mamba2": dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=16),
    "hgrn2": dict(hidden_size=32, num_hidden_layers=2, num_heads=2, expand_ratio=16),
    "delta_net": dict(hidden_size=32, num_hidden_layers=2, num_heads=2),
    "samba": dict(hidden_size=32, num_hidden_layers=2, num_heads=2, state_size=4),
}
# no attention weights, and run in float64 (chunked and step-by-step scans round differently); SAMBA's
# attention layers alternate with Mamba layers
RECURRENT = ("mamba2", "hgrn2", "delta_net", "samba")
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
NEEDS_GPU = "needs a CUDA GPU (run with the gpu marker on a GPU machine)"


def ids_tensor(shape, vocab=VOCAB, seed=0):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


class CausalLMTester:
    """transformers' CausalLMModelTester, for one family: the config and the inputs of every test."""

    def __init__(self, family):
        self.family = family
        self.has_attentions = family not in RECURRENT
        self.num_layers = FAMILIES[family]["num_hidden_layers"]

    def config(self, **overrides):
        kw = dict(FAMILIES[self.family], vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return get_preset(f"{self.family}-125m", **{**kw, **overrides})

    def model(self, seed=0, cls=AutoModelForCausalLM, **overrides):
        torch.manual_seed(seed)
        model = cls.from_config(self.config(**overrides))
        return (model.double() if self.family in RECURRENT else model).eval().to(DEVICE)

    def inputs(self, batch=BATCH, seq=SEQ, seed=0):
        ids = ids_tensor((batch, seq), seed=seed)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture
def tester(family):
    return CausalLMTester(family)


def _heads(model):
    return model.config.num_heads


def assert_close(a, b, **kw):
    torch.testing.assert_close(a, b, **({"rtol": 1e-5, "atol": 1e-5} | kw))


# ---------------------------------------------------------------------------------------------------
# ModelTesterMixin


def test_config(tester, tmp_path):
    """ConfigTester: JSON round trip, save/load, the common attribute names, the Auto class."""
    config = tester.config()
    for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
        assert hasattr(config, name), name
    if tester.has_attentions:
        assert config.num_attention_heads == config.num_heads
    again = type(config).from_dict(config.to_dict())
    assert again.to_diff_dict() == config.to_diff_dict()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(config) and loaded.to_diff_dict() == config.to_diff_dict()
    assert type(config)().model_type == config.model_type  # the defaults build


def test_model_is_small(tester):
    assert sum(p.numel() for p in tester.model().parameters()) < 1_000_000


def test_forward_signature(tester):
    names = list(inspect.signature(tester.model().forward).parameters)
    assert names[:2] == ["input_ids", "attention_mask"]
    assert tester.model().main_input_name == "input_ids"


def test_determinism(tester):
    model, inputs = tester.model(), tester.inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, model(**inputs).logits)


def test_save_load(tester, tmp_path):
    """Same outputs after save_pretrained/from_pretrained, no missing or unexpected keys, safetensors."""
    model, inputs = tester.model(), tester.inputs()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=model.dtype)
    loaded = loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():  # equal weights; the loaded tensors' layout may change the last bit of a matmul
        assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=1e-12, atol=1e-12)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_save_load_from_base_and_to_base(tester, tmp_path):
    """A base model's checkpoint loads into the LM (only the head is new) and an LM's into the base model."""
    base = tester.model(cls=AutoModel)
    base.save_pretrained(tmp_path / "base")
    lm, info = AutoModelForCausalLM.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert set(info["missing_keys"]) == {"lm_head.weight"}
    for n, p in base.state_dict().items():
        assert torch.equal(lm.get_decoder().state_dict()[n].to(p.dtype), p), n
    lm = tester.model(seed=1)
    lm.save_pretrained(tmp_path / "lm")
    base, info = AutoModel.from_pretrained(tmp_path / "lm", output_loading_info=True)
    assert not info["missing_keys"]
    for n, p in base.state_dict().items():
        assert torch.equal(lm.get_decoder().state_dict()[n], p.to(lm.dtype)), n


def test_initialization(tester):
    """transformers' _config_zero_init check: with initializer_range ~0 every weight is 0 or 1 on average
    (Mamba-2's A_log and dt_bias are drawn from their own ranges, as in transformers' own Mamba-2 test)."""
    if tester.family == "samba":
        pytest.skip("SAMBA's reference init draws linear and convolution weights from PyTorch's defaults, not from "
                    "initializer_range (test_samba.py checks it)")
    model = tester.model(initializer_range=1e-10)
    own = {"A_log", "dt_bias", "D"} if tester.family == "mamba2" else set()
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in own:
            continue
        mean = ((p.data.mean() * 1e9).round() / 1e9).item()
        assert mean in (0.0, 1.0), (name, mean)


def test_training(tester):
    model = tester.model()
    model.train()
    inputs = tester.inputs()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    assert loss.dim() == 0
    loss.backward()
    unused = {"model.lower_bounds"}  # HGRN2 stores it and, as released, never uses it
    for n, p in model.named_parameters():
        if n not in unused:
            assert p.grad is not None, n


@pytest.mark.parametrize("use_reentrant", [None, True, False])
def test_training_gradient_checkpointing(tester, use_reentrant):
    inputs = tester.inputs()
    grads = []
    for checkpointing in (False, True):
        model = tester.model()
        model.train()
        if checkpointing:
            kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            assert model.is_gradient_checkpointing
        if use_reentrant:
            model.enable_input_require_grads()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert_close(grads[1][n], grads[0][n], msg=n)


def test_gradient_checkpointing_enable_disable(tester):
    model = tester.model()
    assert not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and model.get_decoder().gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing and not model.get_decoder().gradient_checkpointing


def test_hidden_states_output(tester):
    model, inputs = tester.model(), tester.inputs()
    out = model(**inputs, output_hidden_states=True)
    assert len(out.hidden_states) == tester.num_layers + 1
    assert all(h.shape == (BATCH, SEQ, model.config.hidden_size) for h in out.hidden_states)
    model.config.output_hidden_states = True
    assert len(model(**inputs).hidden_states) == tester.num_layers + 1


def test_attention_outputs(tester):
    model, inputs = tester.model(), tester.inputs()
    if not tester.has_attentions:
        with pytest.raises(ValueError, match="no attention weights"):
            model(**inputs, output_attentions=True)
        pytest.skip("a recurrent model has no attention weights (it refuses output_attentions)")
    out = model(**inputs, output_attentions=True)
    assert len(out.attentions) == tester.num_layers
    assert all(a.shape == (BATCH, _heads(model), SEQ, SEQ) for a in out.attentions)
    assert_close(out.attentions[0].sum(-1), torch.ones(BATCH, _heads(model), SEQ))
    model.set_attn_implementation("eager")  # transformers allows config.output_attentions with eager only
    model.config.output_attentions = True
    both = model(**inputs, output_hidden_states=True)
    assert len(both.attentions) == tester.num_layers and len(both.hidden_states) == tester.num_layers + 1
    assert_close(both.logits, out.logits)


def test_retain_grad_hidden_states_attentions(tester):
    model, inputs = tester.model(), tester.inputs()
    out = model(**inputs, output_hidden_states=True, output_attentions=tester.has_attentions)
    hidden = out.hidden_states[0]
    hidden.retain_grad()
    if tester.has_attentions:
        att = out.attentions[0]
        att.retain_grad()
    out.logits.flatten()[0].backward()
    assert hidden.grad is not None
    if tester.has_attentions:
        assert att.grad is not None


def test_model_outputs_equivalence(tester):
    """return_dict=False gives the dict's values as a tuple, in order."""
    model, inputs = tester.model(), tester.inputs()
    for extra in ({}, {"output_hidden_states": True}, {"labels": inputs["input_ids"]},
                  {"output_attentions": True} if tester.has_attentions else {}):
        d = model(**inputs, **extra, return_dict=True)
        t = model(**inputs, **extra, return_dict=False)
        assert isinstance(t, tuple) and len(t) == len(d.to_tuple())
        for a, b in zip(t, d.to_tuple()):
            if isinstance(a, torch.Tensor):
                assert_close(a, b)
            elif isinstance(a, tuple):
                for x, y in zip(a, b):
                    assert_close(x, y)


def test_model_get_set_embeddings(tester):
    model = tester.model()
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    new = nn.Embedding(VOCAB, model.config.hidden_size).to(model.dtype)
    model.set_input_embeddings(new)
    assert model.get_input_embeddings() is new


def test_resize_tokens_embeddings(tester):
    model = tester.model()
    D = model.config.hidden_size
    before = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 10)
    assert model.config.vocab_size == VOCAB + 10
    assert model.get_input_embeddings().weight.shape == (VOCAB + 10, D)
    assert model.get_output_embeddings().weight.shape == (VOCAB + 10, D)
    assert torch.equal(model.get_input_embeddings().weight[:VOCAB], before)
    ids = ids_tensor((2, 5), vocab=VOCAB + 10)
    assert model(ids).logits.shape == (2, 5, VOCAB + 10)
    model.resize_token_embeddings(VOCAB - 15)
    assert model(ids_tensor((2, 5), vocab=VOCAB - 15)).logits.shape == (2, 5, VOCAB - 15)
    model.resize_token_embeddings(VOCAB, pad_to_multiple_of=64)
    assert model.get_input_embeddings().weight.shape[0] == 128


def test_tie_word_embeddings(tester, tmp_path):
    """tie_word_embeddings=True shares the LM head with the input embeddings, through save and load."""
    model = tester.model(tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    untied = tester.model()
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight


def test_inputs_embeds_matches_input_ids(tester):
    model, inputs = tester.model(), tester.inputs()
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with torch.no_grad():
        assert_close(model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits,
                     model(**inputs).logits)
    with pytest.raises(ValueError, match="exactly one"):
        model(input_ids=inputs["input_ids"], inputs_embeds=embeds)


def test_batching_equivalence(tester):
    model, inputs = tester.model(), tester.inputs()
    with torch.no_grad():
        batch = model(**inputs, output_hidden_states=True)
        for i in range(BATCH):
            alone = model(input_ids=inputs["input_ids"][i:i + 1], output_hidden_states=True)
            assert_close(alone.logits[0], batch.logits[i])
            for a, b in zip(alone.hidden_states, batch.hidden_states):
                assert_close(a[0], b[i])


def test_left_padding_compatibility(tester):
    """The last token's logits of a left-padded batch equal the unpadded ones (GenerationTesterMixin)."""
    model, inputs = tester.model(), tester.inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    pad = torch.zeros(BATCH, 4, dtype=ids.dtype)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        padded = model(input_ids=torch.cat([pad, ids], 1), attention_mask=torch.cat([pad, mask], 1)).logits[:, -1]
    assert_close(padded, plain)


def test_attn_implementation_is_accepted(tester):
    """attn_implementation='eager' / 'sdpa' load and compute the same function (the attention is the FoX
    kernel or SDPA either way; the explicit path is output_attentions)."""
    config = tester.config()
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa" if tester.has_attentions else None).eval()
    ids = tester.inputs()["input_ids"]
    assert_close(eager(ids).logits, sdpa(ids).logits)


def test_can_load_in_bfloat16(tester, tmp_path):
    model = tester.model()
    model.save_pretrained(tmp_path)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    fp32 = set(half._keep_in_fp32_modules_strict or ())  # declared float32 (Mamba-2's A_log)
    for name, p in half.named_parameters():
        assert p.dtype == (torch.float32 if name.rsplit(".", 1)[-1] in fp32 else torch.bfloat16), name
    logits = half(**tester.inputs()).logits
    assert torch.isfinite(logits.float()).all()


def test_torch_export(tester):
    model, inputs = tester.model(), tester.inputs()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    program = torch.export.export(Logits(), (inputs["input_ids"], inputs["attention_mask"]), strict=False)
    assert_close(program.module()(inputs["input_ids"], inputs["attention_mask"]), model(**inputs).logits)


@pytest.mark.skip(reason=NEEDS_GPU + ": multi-GPU DataParallel, model parallelism and the accelerator offload "
                  "tests; disk offload on the CPU is test_outputs.py::test_disk_offload")
def test_multi_gpu_and_accelerator_offload():
    pass


@pytest.mark.skip(reason=NEEDS_GPU + " and flash-attn: flash_attention_2/3 dispatch has no meaning for the FoX "
                  "kernel, which runs its own Triton kernels on a GPU")
def test_flash_attn_equivalence():
    pass


# ---------------------------------------------------------------------------------------------------
# GenerationTesterMixin


def _manual_greedy(model, ids, steps):
    for _ in range(steps):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


def test_greedy_generate(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    with torch.no_grad():
        want = _manual_greedy(model, ids, 5)
        assert torch.equal(model.generate(ids, max_new_tokens=5, **GREEDY), want)
        assert torch.equal(model.generate(ids, max_new_tokens=5, use_cache=False, **GREEDY), want)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_dict_outputs(tester, use_cache):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    out = model.generate(ids, max_new_tokens=4, use_cache=use_cache, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, output_hidden_states=True, output_attentions=tester.has_attentions,
                         **GREEDY)
    assert out.sequences.shape == (BATCH, SEQ + 4)
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == 4
    assert all(s.shape == (BATCH, VOCAB) for s in out.scores)
    for step, hidden in enumerate(out.hidden_states):
        length = SEQ if step == 0 or not use_cache else 1
        total = SEQ + step
        assert len(hidden) == tester.num_layers + 1
        assert hidden[0].shape == (BATCH, length if use_cache else total, model.config.hidden_size)
        if tester.has_attentions:
            assert all(a.shape == (BATCH, _heads(model), length if use_cache else total, total)
                       for a in out.attentions[step])
    if use_cache:
        assert out.past_key_values.get_seq_length() == SEQ + 3


def test_sample_generate(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    kw = dict(do_sample=True, top_k=10, max_new_tokens=5, num_return_sequences=2, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    a = model.generate(ids, **kw)
    torch.manual_seed(0)
    b = model.generate(ids, **kw)
    assert a.shape == (2 * BATCH, SEQ + 5) and torch.equal(a, b)
    assert torch.equal(a[:, :SEQ], ids.repeat_interleave(2, 0))


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_generate(tester, use_cache):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    out = model.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=4, use_cache=use_cache,
                         return_dict_in_generate=True, output_scores=True, length_penalty=0.0, **GREEDY)
    assert out.sequences.shape == (2 * BATCH, SEQ + 4) and out.sequences_scores.shape == (2 * BATCH,)
    assert out.beam_indices.shape[0] == 2 * BATCH
    logp = model(out.sequences, use_cache=False).logits.float().log_softmax(-1)
    scores = logp[:, SEQ - 1:-1].gather(-1, out.sequences[:, SEQ:, None])[..., 0].sum(-1)
    assert_close(scores, out.sequences_scores.float(), rtol=1e-4, atol=1e-4)


def test_beam_search_cache_equals_no_cache(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    kw = dict(num_beams=2, max_new_tokens=4, **GREEDY)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_assisted_decoding_matches_greedy_search(tester):
    model, ids = tester.model(), tester.inputs(batch=1)["input_ids"]
    want = model.generate(ids, max_new_tokens=8, **GREEDY)
    for assistant in (tester.model(), tester.model(seed=3)):
        out = model.generate(ids, assistant_model=assistant, max_new_tokens=8, return_dict_in_generate=True,
                             output_scores=True, **GREEDY)
        assert torch.equal(out.sequences, want) and len(out.scores) == 8


def test_prompt_lookup_decoding_matches_greedy_search(tester):
    model = tester.model()
    ids = ids_tensor((1, 4)).repeat(1, 3)
    want = model.generate(ids, max_new_tokens=8, **GREEDY)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=2, max_new_tokens=8, **GREEDY), want)


def test_assisted_decoding_sample(tester):
    model, ids = tester.model(), tester.inputs(batch=1)["input_ids"]
    torch.manual_seed(0)
    out = model.generate(ids, assistant_model=tester.model(seed=3), do_sample=True, max_new_tokens=6,
                         pad_token_id=0, eos_token_id=None)
    assert out.shape == (1, SEQ + 6)


def test_generate_continue_from_past_key_values(tester):
    """A cache returned by generate() continues generation as one longer call would."""
    model, ids = tester.model(), tester.inputs()["input_ids"]
    full = model.generate(ids, max_new_tokens=6, **GREEDY)
    first = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    cache = first.past_key_values
    assert cache.get_seq_length() == SEQ + 2
    more = model.generate(first.sequences, past_key_values=cache, max_new_tokens=3, **GREEDY)
    assert torch.equal(more, full)


def test_generate_from_inputs_embeds(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    want = model.generate(ids, max_new_tokens=4, **GREEDY)[:, SEQ:]
    embeds = model.get_input_embeddings()(ids)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=4, **GREEDY), want)
    both = model.generate(ids, inputs_embeds=embeds, max_new_tokens=4, **GREEDY)
    assert torch.equal(both[:, SEQ:], want)


def test_generate_continue_from_inputs_embeds(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    full = model.generate(ids, max_new_tokens=4, **GREEDY)
    embeds = model.get_input_embeddings()(ids)
    first = model.generate(inputs_embeds=embeds, max_new_tokens=2, return_dict_in_generate=True, **GREEDY)
    seq = torch.cat([ids, first.sequences], 1)
    more_embeds = model.get_input_embeddings()(seq)
    more = model.generate(inputs_embeds=more_embeds, past_key_values=first.past_key_values, max_new_tokens=2,
                          **GREEDY)
    assert torch.equal(torch.cat([seq, more], 1), full)


def test_generate_methods_with_logits_to_keep(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    assert model(ids, logits_to_keep=1).logits.shape == (BATCH, 1, VOCAB)
    full = model(ids).logits
    keep = torch.tensor([0, ids.shape[1] - 1])  # transformers' other form: the positions to keep
    torch.testing.assert_close(model(ids, logits_to_keep=keep).logits, full[:, keep])
    assert torch.equal(model.generate(ids, max_new_tokens=4, **GREEDY),
                       _manual_greedy(model, ids, 4))


def test_generate_without_input_ids(tester):
    model = tester.model()
    out = model.generate(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (1, 4) and out[0, 0] == model.config.bos_token_id


def test_prepare_inputs_for_generation_kwargs_forwards(tester):
    model, ids = tester.model(), tester.inputs()["input_ids"]
    prepared = model.prepare_inputs_for_generation(ids, past_key_values=None, foo="bar", output_attentions=True)
    assert prepared["foo"] == "bar" and prepared["output_attentions"] is True
    assert torch.equal(prepared["input_ids"], ids)


def test_generation_config_round_trip(tester, tmp_path):
    model = tester.model()
    model.generation_config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.max_new_tokens == 3
    ids = tester.inputs()["input_ids"]
    assert loaded.generate(ids).shape == (BATCH, SEQ + 3)


@torch.no_grad()
def test_cache_reorder_and_batch_selection(tester):
    """The cache is a transformers Cache: reorder_cache, batch_repeat_interleave and batch_select_indices
    act on every state as on the batch."""
    model, ids = tester.model(), tester.inputs()["input_ids"]
    cache = model.model.new_cache()
    model(ids, past_key_values=cache)
    nxt = ids_tensor((BATCH, 1), seed=9)
    order = torch.tensor([2, 0, 1])
    reordered = copy.deepcopy(cache)
    reordered.reorder_cache(order)
    assert_close(model(nxt[order], past_key_values=reordered).logits, model(nxt, past_key_values=copy.deepcopy(cache)).logits[order])
    repeated = copy.deepcopy(cache)
    repeated.batch_repeat_interleave(2)
    assert_close(model(nxt.repeat_interleave(2, 0), past_key_values=repeated).logits,
                 model(nxt, past_key_values=copy.deepcopy(cache)).logits.repeat_interleave(2, 0))
    cache.batch_select_indices(torch.tensor([0, 2]))
    full = model(torch.cat([ids, nxt], 1)[[0, 2]]).logits[:, -1]
    assert_close(model(nxt[[0, 2]], past_key_values=cache).logits[:, -1], full)


def test_past_key_values_format(tester):
    """Every attention layer's cache reads as transformers' (B, Hkv, T, D) ``keys``/``values``: views of the
    (B, T, Hkv, D) tensors the kernels keep (no copy). The recurrent layers keep a fixed-size state."""
    if tester.family in ("mamba2", "hgrn2", "delta_net"):
        pytest.skip("a recurrent model's cache is a fixed-size scan state and convolution windows, no keys/values")
    model, inputs = tester.model(), tester.inputs()
    cache = output_cache(model(**inputs, use_cache=True))
    layers = [layer for layer in cache.layers if isinstance(layer, FoxCacheLayer)]
    assert layers
    config = model.config
    for layer in layers:
        hkv, d = layer.k.shape[2:]
        if tester.family != "samba":
            assert (hkv, d) == (config.num_kv_heads or config.num_heads, config.hidden_size // config.num_heads)
        for kv, own in ((layer.keys, layer.k), (layer.values, layer.v)):
            assert kv.shape == (BATCH, hkv, SEQ, d)
            assert kv.data_ptr() == own.data_ptr() and torch.equal(kv, own.transpose(1, 2))


def test_can_generate(tester):
    """``can_generate()`` as transformers defines it: the causal LM inherits ``GenerationMixin`` (among its own
    bases, as transformers' models do), the backbone does not."""
    lm, base = type(tester.model()), type(tester.model(cls=AutoModel))
    assert lm.can_generate() and GenerationMixin in lm.__bases__
    assert not base.can_generate() and not issubclass(base, GenerationMixin)
    assert not hasattr(tester.model(cls=AutoModel), "generate")


HOLES = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1],   # left padding and a hole
                      [1, 1, 1, 0, 1, 0, 1, 1, 0]])  # two holes and right padding


def test_attention_mask_with_holes(tester):
    """A 2-D mask with zeros anywhere: each kept token's logits and hidden states are those of the row without
    the masked tokens (they get no attention and do not decay, shift into or update the kept ones); with
    attentions, a kept query's weights over the kept keys are the row's own and 0 on masked keys."""
    model = tester.model()
    ids = ids_tensor(tuple(HOLES.shape))
    extra = dict(output_attentions=True) if tester.has_attentions else {}
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=HOLES, output_hidden_states=True, **extra)
        for b, row in enumerate(HOLES.bool()):
            alone = model(input_ids=ids[b, row][None], output_hidden_states=True, **extra)
            assert_close(out.logits[b, row], alone.logits[0])
            for h, h_alone in zip(out.hidden_states, alone.hidden_states, strict=True):
                assert_close(h[b, row], h_alone[0])
            for w, w_alone in zip(out.attentions or (), alone.attentions or (), strict=True):
                assert_close(w[b][:, row][:, :, row], w_alone[0])
                assert not w[b][:, row][:, :, ~row].any()


def test_generate_with_holes_in_the_mask(tester):
    """Greedy generation from a batch whose mask has holes gives each row the tokens of its kept tokens alone;
    the cached continuation equals the full forward with the holed mask. The prompts end with a kept token
    (generate() reads the last position's logits; a masked last token's are meaningless, as with right
    padding in any decoder-only model)."""
    model = tester.model()
    holes = HOLES.clone()
    holes[:, -1] = 1
    ids = ids_tensor(tuple(holes.shape))
    batch = model.generate(ids, attention_mask=holes, max_new_tokens=4, **GREEDY)
    for b, row in enumerate(holes.bool()):
        alone = model.generate(ids[b, row][None], max_new_tokens=4, **GREEDY)
        assert torch.equal(batch[b, ids.shape[1]:], alone[0, int(row.sum()):]), b
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=HOLES, use_cache=True)
        nxt = ids_tensor((2, 1), seed=1)
        mask = torch.cat([HOLES, torch.ones(2, 1, dtype=HOLES.dtype)], 1)
        step = model(input_ids=nxt, attention_mask=mask, past_key_values=output_cache(out)).logits[:, -1]
        full = model(input_ids=torch.cat([ids, nxt], 1), attention_mask=mask).logits[:, -1]
    assert_close(step, full)


def test_blocks_are_gradient_checkpointing_layers(tester):
    """Each block is a transformers ``GradientCheckpointingLayer``: ``gradient_checkpointing_enable()`` switches
    the blocks themselves, and the backward then runs each block's forward again (its first module is called
    twice per training step instead of once)."""
    for checkpointing in (False, True):
        model = tester.model()
        blocks = model.get_decoder().layers
        assert all(isinstance(block, GradientCheckpointingLayer) for block in blocks)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert all(block.gradient_checkpointing == checkpointing for block in blocks)
        model.train()
        calls = []
        next(blocks[0].children()).register_forward_pre_hook(lambda *_: calls.append(1))
        inputs = tester.inputs()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        assert len(calls) == (2 if checkpointing else 1)


@pytest.mark.skip(reason="transformers' test builds its own StaticCache of (B, H, T, D) key/value pairs; these "
                  "models' static cache is StaticFoxCache (K, V in the kernel's format plus prefix sums and shift "
                  "states), tested in tests/test_static_cache.py and test_static_cache_is_taken_or_refused_clearly; "
                  "on a GPU its decoding step is compiled by the cache and captured as a CUDA graph, not the whole "
                  "forward compiled by transformers")
def test_generate_with_static_cache():
    pass


def test_static_cache_is_taken_or_refused_clearly(tester):
    """The attention models decode with a static cache as with their own (tests/test_static_cache.py); the
    recurrent ones refuse it in one line; other cache implementations are refused by all."""
    model, ids = tester.model(), tester.inputs()["input_ids"]
    if type(model.model.new_cache()).__name__ == "FoxCache":
        want = model.generate(ids, max_new_tokens=3, **GREEDY)
        assert torch.equal(model.generate(ids, max_new_tokens=3, cache_implementation="static", **GREEDY), want)
    else:
        with pytest.raises(ValueError, match="a static cache is for the attention models"):
            model.generate(ids, max_new_tokens=2, cache_implementation="static", **GREEDY)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        model.generate(ids, max_new_tokens=2, cache_implementation="offloaded", **GREEDY)
