"""NIAH prompts have the official structure (BOS, haystack with the needle on its own line at the requested
depth, instruction, question); greedy answers; the judge gets the official prompt; the command end to end."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import niah
from fox_eval.cli import build_parser, main


@pytest.fixture(scope="module")
def tok():
    return fox_models.JSONGPT2Tokenizer()


@pytest.fixture(scope="module")
def hay(tok):
    return niah.haystack_ids(tok, niah.haystack_text(), 8000)


def _enc(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def test_defaults_are_the_papers():
    assert niah.LENGTHS == [1000, 4100, 7200, 10300, 13400, 16500, 19600, 22700, 25800, 28900, 32000]
    assert niah.DEPTHS == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    args = build_parser().parse_args(["niah", "--model", "m"])
    assert args.max_new_tokens == 1024 and args.judge_model == "gpt-4o-2024-08-06" and args.haystack is None


@pytest.mark.parametrize("length", [1000, 4100, 7001])
@pytest.mark.parametrize("depth", [0.0, 10.0, 33.0, 50.0, 100.0])
@pytest.mark.parametrize("mode", ["standard", "easy"])
def test_prompt_has_the_official_structure(tok, hay, length, depth, mode):
    ids, at = niah.build_prompt(tok, hay, length, depth, mode)
    needle = _enc(tok, niah.needle_text(mode))
    tail = _enc(tok, "\n\n" + niah.INSTRUCTION + niah.QUESTION)
    hay_len = length - niah.RESERVED_TOKENS - len(needle)
    # BOS, the haystack's first tokens with the needle spliced in, then instruction and question
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + hay_len + len(needle) + len(tail) < length
    assert ids[at : at + len(needle)] == needle and ids[len(ids) - len(tail) :] == tail
    assert ids[1:at] + ids[at + len(needle) : len(ids) - len(tail)] == hay[:hay_len]
    # the needle is a line of its own in the text the model reads
    text = tok.decode(ids, skip_special_tokens=True)
    assert "\n" + (niah.EASY_NEEDLE if mode == "easy" else niah.NEEDLE) + "\n" in text
    assert text.endswith("\n\nThere is an important piece of information hidden inside the above document. Now that "
                         "you've read the document, I will quiz you about it. Answer the following question: What is "
                         "the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is")
    # depth: 100% ends the haystack; otherwise the needle follows the last period at or before the requested
    # token position (or starts the haystack when there is none)
    pos = at - 1
    if depth == 100:
        assert pos == hay_len
    else:
        target = int(hay_len * depth / 100)
        period = _enc(tok, ".")[0]
        assert pos <= target and period not in hay[pos:target]
        assert pos == 0 or hay[pos - 1] == period


def test_haystack_folder_in_name_order_repeated_when_short(tmp_path, tok):
    (tmp_path / "b.txt").write_text("Bravo bravo. ")
    (tmp_path / "a.txt").write_text("Alpha alpha. ")
    (tmp_path / "notes.md").write_text("not part of the haystack")
    text = niah.haystack_text(tmp_path)
    assert text == "Alpha alpha. Bravo bravo. "
    ids = niah.haystack_ids(tok, text, 50)
    assert len(ids) == 50 and tok.decode(ids).startswith("Alpha alpha. Bravo bravo. Alpha alpha. Bravo")
    with pytest.raises(FileNotFoundError, match="--haystack '/no/such' is not a folder"):
        niah.haystack_text("/no/such")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        niah.haystack_text(tmp_path / "empty")


def test_too_short_or_off_range_cells_are_named(tok, hay):
    with pytest.raises(ValueError, match="--lengths: 210 is too short"):
        niah.build_prompt(tok, hay, 210, 50.0)
    with pytest.raises(ValueError, match=r"--depths must lie in \[0, 100\], got 101"):
        niah.build_prompt(tok, hay, 1000, 101)


def test_offline_score():
    assert niah.score_offline(" eat a sandwich and sit in Dolores Park on a sunny day. Then") == 10.0
    assert niah.score_offline(" eat a sandwich and go home") == pytest.approx(10 * 4 / 12)
    assert niah.score_offline(" visit the Golden Gate bridge") == 0.0


@pytest.fixture
def judge_server():
    """A local OpenAI-compatible endpoint that records each request and rates 7 (no rating for NORATING)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            reply = "No rating." if "NORATING" in body["messages"][1]["content"] else "Fine. Rating: [[7]]"
            data = json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1", seen
    server.shutdown()


def test_judge_gets_the_official_prompt(judge_server):
    url, seen = judge_server
    assert niah.score_with_judge("eat a sandwich", url, api_key="k") == 7.0
    assert niah.score_with_judge("NORATING", url) is None
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k" and body["temperature"] == 0
    assert body["model"] == "gpt-4o-2024-08-06" and body["messages"][0]["content"] == "You are a helpful assistant."
    user = body["messages"][1]["content"]
    assert user.startswith("[Instruction]\nPlease act as an impartial judge")
    assert "[Ground truth]\n\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a " \
           "sunny day.\n\nRemember that the model is small" in user
    assert "accuracy: \n    Score 1: The answer is completely unrelated" in user
    assert user.endswith("[Question]\nWhat is the best thing to do in San Francisco?\n\n[The Start of the Model's "
                         "Answer]\neat a sandwich\n[The End of the Model's Answer]")
    with pytest.raises(ValueError, match="--judge-url http://127.0.0.1:9/v1: no judgement after 3 tries"):
        niah.score_with_judge("x", "http://127.0.0.1:9/v1", wait=0)


def _tiny(path):
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    fox_models.JSONGPT2Tokenizer().save_pretrained(path)
    return model


def test_answers_are_greedy(tmp_path, tok, hay):
    model = _tiny(tmp_path / "m")
    ids, _ = niah.build_prompt(tok, hay, 260, 50.0)
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(5):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert niah.generate(model, tok, ids, 5) == tok.decode(x[0, len(ids):], skip_special_tokens=True).strip()


def test_command_writes_results_and_heatmap(tmp_path, judge_server, monkeypatch):
    url, seen = judge_server
    _tiny(tmp_path / "m")
    (tmp_path / "hay").mkdir()
    (tmp_path / "hay" / "essay.txt").write_text("Work on hard problems. Keep your identity small. " * 40)
    entered = []
    real = niah.autocast
    monkeypatch.setattr(niah, "autocast", lambda device: entered.append(str(device)) or real(device))
    main(["niah", "--model", str(tmp_path / "m"), "--lengths", "300", "611", "--depths", "0", "50", "100",
          "--max-new-tokens", "4", "--out", str(tmp_path / "n"), "--mode", "easy", "--haystack", str(tmp_path / "hay"),
          "--judge-url", url])
    report = json.loads((tmp_path / "n" / "niah_easy.json").read_text())
    assert len(report["results"]) == 6 and all(0 <= r["score"] <= 10 for r in report["results"])
    assert all(r["judge_score"] == 7.0 for r in report["results"]) and report["mean_judge_score"] == 7.0
    assert len(seen) == 6 and entered == ["cpu"] * 6
    assert report["haystack"] == str(tmp_path / "hay") and report["max_new_tokens"] == 4
    assert [r["prompt_tokens"] < r["length"] for r in report["results"]] == [True] * 6
    assert (tmp_path / "n" / "niah_easy.png").stat().st_size > 2000
    with pytest.raises(SystemExit, match="^fox-eval: --limit must be >= 1, got 0$"):
        main(["niah", "--model", str(tmp_path / "m"), "--limit", "0"])
    with pytest.raises(SystemExit, match=r"^fox-eval: --depths must lie in \[0, 100\] \(percent\), got \[-5.0\]$"):
        main(["niah", "--model", str(tmp_path / "m"), "--depths", "0", "-5"])
    with pytest.raises(SystemExit, match=r"^fox-eval: --lengths must exceed the 200 tokens .*, got \[150\]$"):
        main(["niah", "--model", str(tmp_path / "m"), "--lengths", "150", "1000"])
    with pytest.raises(SystemExit, match="^fox-eval: --haystack '/no/hay' is not a folder$"):
        main(["niah", "--model", str(tmp_path / "m"), "--haystack", "/no/hay"])


def test_a_failing_judge_or_a_crash_loses_no_finished_cell(tmp_path, judge_server, monkeypatch):
    """A judge call that fails after its tries is recorded as null with its error, not the end of the run;
    every finished cell is on disk at once, so a run stopped half-way and run again generates only the
    cells it lacks and asks the judge again only where it failed."""
    url, seen = judge_server
    _tiny(tmp_path / "m")
    monkeypatch.setattr(niah.time, "sleep", lambda seconds: None)
    real_judge, real_generate = niah.score_with_judge, niah.generate
    down = {"on": True}

    def flaky_judge(text, url, **kw):  # the endpoint is down for the run's third and fourth cells
        if down["on"] and len(seen) in (2, 3):
            seen.append(None)
            return real_judge(text, "http://127.0.0.1:9/v1", **kw)
        return real_judge(text, url, **kw)

    monkeypatch.setattr(niah, "score_with_judge", flaky_judge)
    args = ["niah", "--model", str(tmp_path / "m"), "--lengths", "300", "611", "--depths", "0", "50", "100",
            "--max-new-tokens", "4", "--out", str(tmp_path / "n"), "--mode", "easy", "--judge-url", url]
    main(args)
    report = json.loads((tmp_path / "n" / "niah_easy.json").read_text())
    scores = [r["judge_score"] for r in report["results"]]
    assert scores == [7.0, 7.0, None, None, 7.0, 7.0] and report["mean_judge_score"] == 7.0
    assert all("no judgement after 3 tries" in r["judge_error"] for r in report["results"][2:4])
    # again: nothing generated, the judge asked for the two failed cells only
    down["on"] = False
    generated = []
    monkeypatch.setattr(niah, "generate", lambda *a: generated.append(a) or real_generate(*a))
    before = len(seen)
    main(args)
    again = json.loads((tmp_path / "n" / "niah_easy.json").read_text())
    assert generated == [] and len(seen) - before == 2
    assert [r["judge_score"] for r in again["results"]] == [7.0] * 6 and not any("judge_error" in r for r in again["results"])
    assert [r["continuation"] for r in again["results"]] == [r["continuation"] for r in report["results"]]

    # a run stopped after two cells: the next one generates the other four
    calls = []

    def stops(*a):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(a)
        return real_generate(*a)

    monkeypatch.setattr(niah, "generate", stops)
    fresh = [*args[:-2], "--out", str(tmp_path / "k")]
    fresh = [a for a in fresh if a != "--judge-url"]
    with pytest.raises(SystemExit):
        main(fresh)
    generated.clear()
    monkeypatch.setattr(niah, "generate", lambda *a: generated.append(a) or real_generate(*a))
    main(fresh)
    assert len(generated) == 4
    whole = json.loads((tmp_path / "k" / "niah_easy.json").read_text())
    assert [r["continuation"] for r in whole["results"]] == [r["continuation"] for r in report["results"]]


def test_a_repeated_length_or_depth_is_one_column_or_row_of_the_heat_map(tmp_path, tok, monkeypatch):
    model = _tiny(tmp_path / "m")
    drawn = []
    monkeypatch.setattr(niah, "heatmap", lambda results, lengths, depths, *a: drawn.append((lengths, depths)))
    report = niah.run(model, tok, tmp_path / "n", "standard", [300, 300], [0.0, 100.0, 0.0], max_new_tokens=2)
    assert [(r["length"], r["depth"]) for r in report["results"]] == [(300, 0.0), (300, 100.0)]
    assert report["lengths"] == [300] and report["depths"] == [0.0, 100.0]
    assert drawn == [([300], [0.0, 100.0])]
