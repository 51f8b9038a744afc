"""lm-eval-harness through its Python API with our model object, and tables across models."""

from __future__ import annotations

import json
from pathlib import Path

# The paper's zero-shot tasks and the metric reported for each (FOX.md section 5).
PAPER_TASKS = {
    "wikitext": "word_perplexity,none",
    "lambada_openai": "acc,none",
    "piqa": "acc,none",
    "hellaswag": "acc_norm,none",
    "winogrande": "acc,none",
    "arc_easy": "acc,none",
    "arc_challenge": "acc_norm,none",
    "copa": "acc,none",
    "openbookqa": "acc_norm,none",
    "sciq": "acc,none",
    "boolq": "acc,none",
}
LOWER_IS_BETTER = ("perplexity",)


def _fox_lm_class():
    from lm_eval.models.huggingface import HFLM

    class FoxLM(HFLM):
        """HFLM that starts every context with BOS (as FoX was trained) but does not score a BOS inside
        rolling windows, whose first token is already lm-eval's prefix token (the same EOT/BOS)."""

        def loglikelihood_rolling(self, requests, *args, **kwargs):
            saved, self.add_bos_token = self.add_bos_token, False
            try:
                return super().loglikelihood_rolling(requests, *args, **kwargs)
            finally:
                self.add_bos_token = saved

    return FoxLM


def evaluate(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             batch_size: int = 1, device: str = "cpu") -> dict:
    """Run lm-eval tasks (names, or tasks defined in YAML files under ``include_path``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = _fox_lm_class()(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, device=device, add_bos_token=True,
              max_length=getattr(model.config, "max_position_embeddings", 2048))
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False,
                          bootstrap_iters=0)
    return out["results"]


def pick_metrics(results: dict, tasks: list[str]) -> dict[str, tuple[str, float]]:
    """task -> (metric, value): the paper's metric where known, else the task's first numeric metric."""
    picked = {}
    for task in tasks:
        res = results.get(task, {})
        key = PAPER_TASKS.get(task)
        if key not in res:
            key = next((k for k, v in res.items() if "," in k and "stderr" not in k and isinstance(v, (int, float))), None)
        if key is not None:
            picked[task] = (key.split(",")[0], float(res[key]))
    return picked


def tables(per_model: dict[str, dict[str, tuple[str, float]]]) -> tuple[str, str]:
    """Markdown and LaTeX tables (models x tasks), the best value per task in bold."""
    tasks = sorted({t for m in per_model.values() for t in m})
    best = {}
    for t in tasks:
        vals = [(m[t][1], m[t][0]) for m in per_model.values() if t in m]
        lower = any(w in vals[0][1] for w in LOWER_IS_BETTER)
        best[t] = (min if lower else max)(v for v, _ in vals)
    header = ["model", *(f"{t} ({next(m[t][0] for m in per_model.values() if t in m)})" for t in tasks)]

    def cell(m, t, bold):
        if t not in m:
            return "-"
        v = m[t][1]
        text = f"{v:.2f}" if v > 1.5 else f"{100 * v:.2f}"
        return bold(text) if v == best[t] else text

    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tex = ["\\begin{tabular}{l" + "r" * len(tasks) + "}", " & ".join(h.replace("_", "\\_") for h in header) + " \\\\",
           "\\hline"]
    for name, m in per_model.items():
        md.append("| " + " | ".join([name, *(cell(m, t, lambda s: f"**{s}**") for t in tasks)]) + " |")
        tex.append(" & ".join([name.replace("_", "\\_"), *(cell(m, t, lambda s: f"\\textbf{{{s}}}") for t in tasks)]) + " \\\\")
    tex.append("\\end{tabular}")
    return "\n".join(md) + "\n", "\n".join(tex) + "\n"


def run(models: list[str], tasks: list[str], out: Path, include_path: str | None, limit, batch_size: int, device: str):
    from transformers import AutoTokenizer

    from fox_eval.per_token_loss import load_model

    out.mkdir(parents=True, exist_ok=True)
    per_model, raw = {}, {}
    for path in models:
        import torch

        model = load_model(path, torch.device(device))
        tok = AutoTokenizer.from_pretrained(path)
        name = Path(path).resolve().name
        raw[name] = evaluate(model, tok, tasks, include_path, limit, batch_size, device)
        per_model[name] = pick_metrics(raw[name], tasks)
    (out / "results.json").write_text(json.dumps({"raw": raw, "picked": per_model}, indent=1, default=str))
    md, tex = tables(per_model)
    (out / "results.md").write_text(md)
    (out / "results.tex").write_text(tex)
    return per_model, md
