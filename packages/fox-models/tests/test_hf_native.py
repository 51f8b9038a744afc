"""FoX models as a Hugging Face user meets them: remote-code loading without ``import fox_models``, the
Trainer, PEFT LoRA, pipelines, beam search and lm-eval, on tiny models made here (CPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fox_models
from fox_models.presets import get_preset

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2)


def tiny_model(family: str = "fox-pro", seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(get_preset(f"{family}-125m", **TINY)).eval()


def export(model, path):
    model.save_pretrained(path)
    fox_models.JSONGPT2Tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama", "mamba2", "samba"])
def test_folder_loads_with_trust_remote_code_and_no_import(tmp_path, family):
    d = export(tiny_model(family), tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("fox_remote.") and (d / "fox_remote.py").exists()
    ids = [[50256, 600, 31, 7, 4242, 17]]
    expected = tiny_model(family)(torch.tensor(ids)).logits
    code = f"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
assert "fox_models" not in sys.modules
m = AutoModelForCausalLM.from_pretrained({str(d)!r}, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained({str(d)!r}, trust_remote_code=True)
gen = pipeline("text-generation", model={str(d)!r}, trust_remote_code=True)
out = gen("static int", max_new_tokens=4, do_sample=False)[0]["generated_text"]
print(json.dumps({{"model": type(m).__module__, "tok": type(tok).__name__, "ids": tok("a\\tb")["input_ids"],
                  "logits": m(torch.tensor({ids})).logits.tolist(), "gen": out}}))
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["model"] == f"fox_models.{family.split('-')[0]}.modeling" and got["tok"] == "JSONGPT2Tokenizer"
    assert got["ids"] == fox_models.JSONGPT2Tokenizer()("a\tb")["input_ids"]  # the JSON-escaped ids, BOS first
    torch.testing.assert_close(torch.tensor(got["logits"]), expected)
    assert got["gen"].startswith("static int") and len(got["gen"]) > len("static int")


def test_trainer_with_the_language_modelling_collator(tmp_path):
    Dataset = pytest.importorskip("datasets").Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model = tiny_model()
    model.train()
    tok = fox_models.JSONGPT2Tokenizer()
    tok.pad_token = tok.eos_token
    texts = [f"static int f{i}(void) {{ return {i * i}; }}" * (1 + i % 3) for i in range(24)]
    data = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses))) and result.global_step == 5
    assert losses[-1] < losses[0]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_lora_on_every_projection_changes_the_output_and_trains(tmp_path):
    peft = pytest.importorskip("peft")
    LoraConfig, PeftModel, get_peft_model = peft.LoraConfig, peft.PeftModel, peft.get_peft_model

    base = tiny_model()
    ids = torch.randint(0, 50257, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = base(ids).logits.detach()
    targets = ["q_proj", "k_proj.linear", "v_proj.linear", "ogate_proj", "fgate_proj", "o_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert not torch.allclose(model(ids).logits, reference)  # the adapters are in the function
    model.train()
    model(ids, labels=ids).loss.backward()
    for target in targets:  # every adapted projection gets a gradient through the attention
        grads = [p.grad for n, p in lora.items() if f".{target}.lora_" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), target
    model.eval()
    adapted = model(ids).logits.detach()
    model.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter").eval()
    torch.testing.assert_close(again(ids).logits, adapted)
    merged = again.merge_and_unload()
    assert type(merged.model.layers[0].attn.q_proj) is torch.nn.Linear  # merged: the fused projection again
    torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-5, rtol=1e-4)


def test_lora_on_the_lm_head_is_in_the_loss():
    """A LoRA adapter on lm_head: the loss (both conventions) is the cross-entropy of the logits the
    adapted head returns, and the adapter trains through it."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("fox-llama"), peft.LoraConfig(r=4, target_modules=["lm_head"],
                                                                         init_lora_weights=False))
    ids = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    logits = out.logits.float()
    torch.testing.assert_close(out.loss, F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:]))
    per_token = model(input_ids=ids, labels=ids, per_token_loss=True).loss
    torch.testing.assert_close(per_token, F.cross_entropy(logits.transpose(1, 2), ids, reduction="none"))
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lm_head.lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("family", ["fox-pro", "transformer-llama", "mamba2"])
def test_shift_labels_replace_labels_in_the_loss(family):
    """``shift_labels`` (targets already aligned with the outputs, as sequence/context parallel training
    passes them) are the loss's targets, every position scored, -100 ignored; ``labels`` beside them do
    not count; ``num_items_in_batch`` divides their sum."""
    model = tiny_model(family)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 50257, (2, 9), generator=g)
    shift = torch.randint(0, 50257, (2, 9), generator=g)
    shift[0, 3] = shift[1, -1] = -100
    logits = model(ids).logits.float()
    want = F.cross_entropy(logits.transpose(1, 2), shift, ignore_index=-100)
    torch.testing.assert_close(model(ids, labels=ids, shift_labels=shift).loss, want)
    torch.testing.assert_close(model(ids, labels=torch.flip(ids, [1]), shift_labels=shift).loss, want)
    torch.testing.assert_close(model(ids, shift_labels=shift).loss, want)
    summed = F.cross_entropy(logits.transpose(1, 2), shift, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(model(ids, labels=ids, shift_labels=shift, num_items_in_batch=5).loss, summed / 5)
    per_token = model(ids, shift_labels=shift, per_token_loss=True).loss
    torch.testing.assert_close(per_token, F.cross_entropy(logits.transpose(1, 2), shift, reduction="none"))


def test_beam_search_matches_scores_of_the_full_forward():
    model = tiny_model("fox-llama", seed=3)
    prompt = torch.tensor([[50256, 91, 1337, 42]])
    out = model.generate(prompt, num_beams=3, num_return_sequences=3, max_new_tokens=5, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, length_penalty=0.0, pad_token_id=50256)
    assert out.sequences.shape == (3, 9)
    for seq, score in zip(out.sequences, out.sequences_scores):  # the beams' log-probabilities, recomputed at once
        logp = torch.log_softmax(model(seq[None]).logits[0, 3:-1].double(), -1)
        torch.testing.assert_close(logp.gather(-1, seq[4:, None]).sum().float(), score, atol=1e-4, rtol=1e-4)


def test_lm_eval_hf_model_scores_like_the_model(tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    d = export(tiny_model(), tmp_path / "m")
    lm = HFLM(pretrained=str(d), trust_remote_code=True, batch_size=2, device="cpu")
    reqs = [Instance("loglikelihood", {}, ("int main(void)", " { return 0; }"), 0),
            Instance("loglikelihood", {}, ("x =", " y + 1;"), 1)]
    got = [ll for ll, _ in lm.loglikelihood(reqs)]
    tok, model = fox_models.JSONGPT2Tokenizer(), tiny_model()
    for (context, cont), ll in zip([r.args for r in reqs], got):  # lm-eval puts BOS first, as the tokenizer does
        c, w = tok(context)["input_ids"], tok(cont, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([c + w])
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)[len(c) - 1 :]
        assert abs(logp.gather(-1, torch.tensor(w)[:, None]).sum().item() - ll) < 1e-4


def test_config_answers_to_the_standard_names(tmp_path):
    config = get_preset("fox-pro-125m", **TINY)
    assert config.num_attention_heads == config.num_heads == 2
    config.num_attention_heads = 4  # transformers code may set it too
    assert config.num_heads == 4
    config.save_pretrained(tmp_path)
    assert "num_attention_heads" not in json.loads((tmp_path / "config.json").read_text())  # the published names only
