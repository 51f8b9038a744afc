"""lm-eval-harness through its Python API with our model object, as the paper ran it (zero-shot, contexts up
to 16384 tokens, BOS first, bf16 autocast on a GPU), and one table across models."""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path

import torch

from fox_eval.loading import autocast, load_model, load_tokenizer, model_labels, precision
from fox_eval.tables import tables

# The paper's table: (task, metric) per column, in its order; the average is over the accuracies.
PAPER_COLUMNS = [
    ("wikitext", "word_perplexity,none"),
    ("lambada_openai", "perplexity,none"),
    ("lambada_openai", "acc,none"),
    ("piqa", "acc,none"),
    ("hellaswag", "acc_norm,none"),
    ("winogrande", "acc,none"),
    ("arc_easy", "acc,none"),
    ("arc_challenge", "acc_norm,none"),
    ("copa", "acc,none"),
    ("openbookqa", "acc_norm,none"),
    ("sciq", "acc,none"),
    ("boolq", "acc,none"),
]
PAPER_TASKS = list(dict.fromkeys(task for task, _ in PAPER_COLUMNS))
MAX_LENGTH = 16384
AVERAGE = "average (acc)"


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


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None):
    """lm-eval's index of tasks, groups and tags (its own and those under ``include_path``), built once per
    ``include_path``: building it reads every task YAML of lm-eval (seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def check_tasks(tasks: list[str], include_path: str | None = None) -> None:
    """ValueError in one line naming the ``--tasks`` entries that are neither a task, group or tag that lm-eval
    knows nor a task YAML file, with the closest known names and the command that lists them all (lm-eval
    itself raises a KeyError from deep inside its task loader)."""
    known = task_manager(include_path).task_index
    unknown = [t for t in tasks if t not in known and not Path(t).is_file()]
    if not unknown:
        return
    close = list(dict.fromkeys(c for t in unknown for c in difflib.get_close_matches(t, known, n=3)))
    where = f" or under --include-path {include_path!r}" if include_path else ""
    hint = f"; close: {', '.join(close)}" if close else ""
    raise ValueError(f"--tasks {' '.join(unknown)}: no such task, group or tag in lm-eval{where}{hint}; "
                     f"'lm-eval ls tasks{f' --include_path {include_path}' if include_path else ''}' lists the "
                     f"{len(known)} valid names")


def evaluate(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             batch_size: int = 1, device: str = "cpu", max_length: int = MAX_LENGTH) -> dict:
    """Run lm-eval tasks zero-shot (names, or tasks defined in YAML files under ``include_path``); contexts
    longer than ``max_length`` tokens are cut from the left by lm-eval."""
    from lm_eval import simple_evaluate

    if max_length < 1:
        raise ValueError(f"--max-length must be >= 1, got {max_length}")
    check_tasks(tasks, include_path)
    lm = _fox_lm_class()(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                         device=device, add_bos_token=True, max_length=max_length)
    manager = task_manager(include_path)
    with autocast(device), torch.no_grad():
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=0,
                              log_samples=False, bootstrap_iters=0)
    return out["results"]


def _percent(metric: str) -> bool:
    return not any(w in metric for w in ("perplexity", "bits", "bytes"))


def pick_metrics(results: dict, tasks: list[str]) -> dict[str, float]:
    """Column "task (metric)" -> value as printed: the paper's columns for its tasks (accuracies in percent),
    the first numeric metric for any other task, and the average of the paper's accuracies when all are there.
    A task YAML file or a tag in ``tasks`` is reported under the names of the tasks it holds: those follow."""
    picked = {}
    names = [t for t in tasks if t in results]
    if len(names) < len(tasks):
        names += [t for t in results if t not in names]
    for task in names:
        res = results.get(task, {})
        keys = [m for t, m in PAPER_COLUMNS if t == task and m in res]
        if not keys:
            keys = [next((k for k, v in res.items() if "," in k and "stderr" not in k and isinstance(v, (int, float))
                          and not isinstance(v, bool)), None)]
        for key in filter(None, keys):
            metric, value = key.split(",")[0], float(res[key])
            picked[f"{task} ({metric})"] = 100 * value if _percent(metric) and 0 <= value <= 1 else value
    accs = [f"{t} ({m.split(',')[0]})" for t, m in PAPER_COLUMNS if m.startswith("acc")]
    if all(c in picked for c in accs):
        picked[AVERAGE] = sum(picked[c] for c in accs) / len(accs)
    return picked


def run(models: list[str], tasks: list[str], out: Path, include_path: str | None, limit, batch_size: int,
        device: str, max_length: int = MAX_LENGTH, labels: list[str] | None = None):
    """Evaluate each model folder; write results.json (raw lm-eval results and the table's values per model)
    and results.md / results.tex (models x tasks). Returns (values per model, markdown)."""
    names = model_labels(models, labels)
    check_tasks(tasks, include_path)  # before any model loads
    out.mkdir(parents=True, exist_ok=True)
    per_model, raw = {}, {}
    for path, name in zip(models, names):
        model = load_model(path, torch.device(device))
        raw[name] = evaluate(model, load_tokenizer(path), tasks, include_path, limit, batch_size, device, max_length)
        per_model[name] = pick_metrics(raw[name], tasks)
        del model
    lower = {c for m in per_model.values() for c in m if "perplexity" in c}
    md, tex = tables(per_model, lower_is_better=lower)
    settings = {"tasks": tasks, "limit": limit, "max_length": max_length, "num_fewshot": 0,
                "precision": precision(device), "models": {n: str(Path(p).resolve()) for n, p in zip(names, models)}}
    (out / "results.json").write_text(json.dumps({"settings": settings, "table": per_model, "raw": raw}, indent=1,
                                                 default=str))
    (out / "results.md").write_text(md)
    (out / "results.tex").write_text(tex)
    return per_model, md
