"""fox-eval inspect: decay times, F and attention matrices and pruning fractions match direct computations."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import inspect_cmd
from fox_eval.cli import main
from fox_models import inspect as fi

FAST, SLOW = 2.0, 1000.0  # decay times set by the test


def _model_with_set_gates(tmp_path):
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                                 qk_norm=True, use_output_gate=True, use_output_norm=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in fi.attention_layers(model):
            layer.fgate_proj.weight.zero_()
            layer.fgate_proj.bias.copy_(torch.tensor([-math.log(math.expm1(1 / FAST)), -math.log(math.expm1(1 / SLOW))]))
    model.save_pretrained(tmp_path / "m")
    fox_models.JSONGPT2Tokenizer().save_pretrained(tmp_path / "m")
    return model


def test_statistics_match_set_values_and_direct_computation(tmp_path):
    model = _model_with_set_gates(tmp_path)
    ids = torch.randint(0, 50257, (1, 300), generator=torch.Generator().manual_seed(0))
    stats = fi.gate_statistics(model, ids, block=32)
    for layer in stats:
        assert layer[0]["decay_time"] == pytest.approx(FAST, rel=1e-4)
        assert layer[1]["decay_time"] == pytest.approx(SLOW, rel=1e-4)
    caps = fi.capture(model, ids)
    cap = caps[1]
    # F equals exp(c_i - c_j) computed directly
    lf = cap.log_fgate[:, 0].double()
    F = fi.forget_matrix(cap, 0)
    for i, j in ((5, 5), (40, 3), (299, 250), (3, 40)):
        expected = math.exp(lf[j + 1 : i + 1].sum().item()) if j <= i else 0.0
        assert F[i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    # attention rows sum to 1 and equal a direct softmax
    A = fi.attention_matrix(cap, 1, block=64)
    torch.testing.assert_close(A.sum(-1), torch.ones(300), rtol=1e-5, atol=1e-5)
    i = 123
    c = torch.cumsum(cap.log_fgate[:, 1].double(), 0)
    s = cap.q[i, 1].double() @ cap.k[: i + 1, 1].double().T / math.sqrt(16) + c[i] - c[: i + 1]
    torch.testing.assert_close(A[i, : i + 1].double(), torch.softmax(s, -1), rtol=1e-5, atol=1e-6)
    # pruning fraction equals a direct count of skippable tiles
    for head, stat in enumerate(stats[1]):
        q, k = cap.q[:, head].double(), cap.k[:, head].double()
        u = q.norm(dim=-1).max() * k.norm(dim=-1).max() / 4
        delta = -(2 * u + math.log(300)) - 10
        ch = torch.cumsum(cap.log_fgate[:, head].double(), 0)
        blocks = [(qb, kb) for qb in range(10) for kb in range(qb + 1)]
        skip = sum(1 for qb, kb in blocks if kb < qb and ch[qb * 32] - ch[min(kb * 32 + 31, 299)] < delta)
        assert stat["pruned_fraction"] == pytest.approx(skip / len(blocks), abs=1e-6)
    assert stats[1][0]["pruned_fraction"] > 0.5 and stats[1][1]["pruned_fraction"] == 0.0


def test_cli_writes_json_and_figures(tmp_path, capsys):
    _model_with_set_gates(tmp_path)
    (tmp_path / "t.txt").write_text("And God said, Let there be light: and there was light. " * 30)
    out = tmp_path / "ins"
    main(["inspect", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--layers", "1",
          "--heads", "0", "1", "--out", str(out), "--block", "32"])
    report = json.loads((out / "inspect.json").read_text())
    assert report["layers"][0][0]["decay_time"] == pytest.approx(FAST, rel=1e-4)
    for name in ("decay_times.png", "layer1_head0.png", "layer1_head1.png"):
        assert (out / name).stat().st_size > 2000
    assert "decay times" in capsys.readouterr().out


def test_models_without_forget_gate_say_so(tmp_path):
    """A model without forget gates, or a text file without text, is a refusal (exit status 1), not a run that
    inspects nothing (or one BOS token) and exits 0."""
    cfg = fox_models.TransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "t")
    (tmp_path / "x.txt").write_text("hello world " * 10)
    with pytest.raises(SystemExit, match=rf"^fox-eval: --model '{tmp_path / 't'}': .* has no forget gate"):
        main(["inspect", "--model", str(tmp_path / "t"), "--text", str(tmp_path / "x.txt"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(SystemExit, match=rf"^fox-eval: --text '{tmp_path / 'empty.txt'}' holds no text$"):
        main(["inspect", "--model", str(tmp_path / "t"), "--text", str(tmp_path / "empty.txt")])


@pytest.mark.parametrize("T", [300, 512, 755, 1100, 1537])
def test_maps_are_drawn_at_the_scale_of_T(tmp_path, T):
    """Pixels land at the tokens they average, and both axes span tokens 0..T (T not a multiple of 512 too)."""
    points = [(T - 1, 0), (T - 1, T - 1), (T // 3, T // 5), (T // 2, 7)]
    m = torch.zeros(T, T)
    for i, j in points:
        m[i, j] = 1.0
    img, f = inspect_cmd._downsample(m)
    assert f == -(-T // 512) and img.shape == (-(-T // f),) * 2
    assert (img.shape[0] - 1) * f < T <= img.shape[0] * f  # the last tile row holds query T - 1, no tile lies past it
    expected = {(i // f, j // f) for i, j in points}
    assert {tuple(int(x) for x in rc) for rc in zip(*img.nonzero())} == expected
    for i, j in points:  # a tile's mean counts only the entries inside the matrix
        rows = min(f, T - (i // f) * f)
        cols = min(f, T - (j // f) * f)
        assert img[i // f, j // f] == pytest.approx(sum(1 for p in points if (p[0] // f, p[1] // f) == (i // f, j // f))
                                                     / (rows * cols))
    fig = inspect_cmd.matrix_figure(m, m, tmp_path / "m.png", "t")
    for ax in fig.axes[:2]:
        left, right, bottom, top = ax.images[0].get_extent()
        assert (left, top) == (0, 0) and right == bottom == img.shape[0] * f
        assert ax.get_xlim() == (0, T) and ax.get_ylim() == (T, 0)


def _inside(fig):
    """Every axes' drawn artists (title, axis labels, tick labels; the colorbar's label) lie inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure comes back closed; draw it again as savefig did
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        e = ax.get_tightbbox(renderer)
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 and e.y1 <= box.y1 + 1, ax


@pytest.mark.parametrize("layers,heads", [(1, 1), (2, 2), (3, 2), (24, 12)])
def test_decay_heatmap_labels_fit_and_ticks_are_whole(tmp_path, layers, heads):
    stats = [[{"decay_time": 10.0 ** ((li * heads + h) % 5)} for h in range(heads)] for li in range(layers)]
    fig = inspect_cmd.decay_heatmap(stats, tmp_path / "d.png", "decay time -1/mean(log f) per head\n(755 tokens)")
    ax = fig.axes[0]
    for ticks, n in ((ax.get_xticks(), heads), (ax.get_yticks(), layers)):
        shown = [t for t in ticks if -0.5 <= t <= n - 0.5]
        assert shown and all(float(t).is_integer() for t in shown), ticks
    assert fig.axes[1].get_ylabel() == "decay time (tokens)"  # the colorbar
    _inside(fig)  # titles, axis labels, tick labels and the colorbar's label all lie inside the figure
