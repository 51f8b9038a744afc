"""Bad input to fox-eval ends in one line naming the option, what it accepts and what it got, before a model
loads: an unknown harness task, a text folder without text, a missing model folder, sampling settings that
are no distribution."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval.cli import main
from fox_eval.loading import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "m"
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    fox_models.JSONGPT2Tokenizer().save_pretrained(d)
    return d


def _message(e) -> str:
    message = str(e.value.code)
    assert "\n" not in message, message
    return message


def test_an_unknown_harness_task_is_one_line_with_close_names(tmp_path, model_dir):
    """lm-eval raised a KeyError traceback from inside its task loader, after the model had loaded."""
    with pytest.raises(SystemExit) as e:
        main(["harness", "--model", str(model_dir), "--tasks", "piqa", "hellaswagg", "--device", "cpu",
              "--out", str(tmp_path / "out")])
    message = _message(e)
    assert message.startswith("fox-eval: --tasks hellaswagg: no such task, group or tag in lm-eval; close: hellaswag")
    assert message.endswith("; 'lm-eval ls tasks' lists the "
                            f"{int(message.rsplit(' lists the ', 1)[1].split()[0])} valid names")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["per-token-loss", "inspect"])
def test_text_data_from_a_folder_without_text_is_one_line(tmp_path, model_dir, command):
    """The tokenizer met an empty list of documents (IndexError traceback)."""
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.md").write_text("not a .txt file")
    args = ["--seq-len", "8"] if command == "per-token-loss" else []
    with pytest.raises(SystemExit) as e:
        main([command, "--model", str(model_dir), "--data", f"text:{empty}", *args, "--device", "cpu",
              "--out", str(tmp_path / "out")])
    assert _message(e) == (f"fox-eval: --data 'text:{empty}': the folder holds no .txt files (text:PATH takes a "
                           f".txt file or a folder of them)")


def test_a_missing_model_folder_is_named_as_a_folder(tmp_path):
    """Not "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" (the Hub client's answer)."""
    missing = str(tmp_path / "no-such-model")
    expected = f"--model '{missing}' does not exist (expected a local model folder)"
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(missing)
    assert str(e.value) == expected
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", missing, "hi"])
    assert _message(e) == f"fox-eval: {expected}"


def test_paths_of_the_wrong_kind_and_a_judge_url_that_is_none_are_named(tmp_path, model_dir):
    """An --out that is a file ("Not a directory: '.../partial'"), an --text that is a folder ("Is a
    directory"), a --judge-url without http(s) ("unknown url type", after the first generation)."""
    story = tmp_path / "story.txt"
    story.write_text("In the beginning. " * 20)
    cases = [
        (["per-token-loss", "--data", f"text:{story}", "--seq-len", "8", "--out", str(story)],
         f"fox-eval: --out '{story}' is a file; it must be a folder (made if missing)"),
        (["inspect", "--text", str(tmp_path)], f"fox-eval: --text '{tmp_path}' is a folder; it must be a text file"),
        (["niah", "--judge-url", "notaurl"],
         "fox-eval: --judge-url must be an http(s) URL of an OpenAI-compatible API (.../v1), got 'notaurl'"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            main([*args[:1], "--model", str(model_dir), "--device", "cpu", *args[1:]])
        assert _message(e) == message


def test_weights_that_lack_a_parameter_are_refused(tmp_path, model_dir):
    """transformers initialises a parameter the file lacks, prints its table and goes on: the evaluation ran
    on a partly random model with exit code 0."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fox_eval.loading import load_model

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    dropped = next(k for k in sorted(weights) if k.endswith("fgate_proj.bias"))
    del weights[dropped]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^--model '{broken}' cannot be loaded: its weights lack .*fgate_proj.bias$"):
        load_model(str(broken), torch.device("cpu"))
    assert load_model(str(model_dir), torch.device("cpu")).training is False  # the whole file loads


@pytest.mark.parametrize(("args", "message"), [
    (["--temperature", "1", "--top-p", "2"], "--top-p must be in (0, 1] (the probability mass sampled from), got 2"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1] (the probability mass sampled from), got 0"),
    (["--temperature", "1", "--top-p", "-0.5"], "--top-p must be in (0, 1] (the probability mass sampled from), got -0.5"),
    (["--temperature", "1", "--top-p", "nan"], "--top-p must be in (0, 1] (the probability mass sampled from), got nan"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (the probability mass sampled from), got 2"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0: greedy), got -1"),
])
def test_generate_refuses_sampling_settings_that_are_no_distribution(model_dir, capsys, args, message):
    """--top-p 2 or 0 sampled anyway (transformers accepts any float there); a negative temperature failed
    only after the model had loaded."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "2", *args, "hi"])
    assert _message(e) == f"fox-eval: {message}"
    assert capsys.readouterr().out == ""
    main(["generate", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "2", "--temperature", "1",
          "--top-p", "1", "hi"])
