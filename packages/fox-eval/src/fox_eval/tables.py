"""Result tables as the paper prints them: one row per model, one column per task, the best value of each
column in bold (and the second best underlined in LaTeX)."""

from __future__ import annotations


def _ranks(rows: dict[str, dict[str, float]], columns: list[str], lower_is_better: set[str]):
    best, second = {}, {}
    for c in columns:
        values = sorted({r[c] for r in rows.values() if r.get(c) is not None}, reverse=c not in lower_is_better)
        best[c] = values[0] if values else None
        second[c] = values[1] if len(values) > 1 else None
    return best, second


def tables(rows: dict[str, dict[str, float]], columns: list[str] | None = None,
           lower_is_better: set[str] | frozenset[str] = frozenset()) -> tuple[str, str]:
    """Markdown and LaTeX tables of ``rows`` (model -> column -> value), values printed with two decimals,
    "-" where a model has no value. ``columns`` fixes the order (default: first seen)."""
    if columns is None:
        columns = list(dict.fromkeys(c for r in rows.values() for c in r))
    best, second = _ranks(rows, columns, set(lower_is_better))

    def cell(r, c, bold, underline):
        v = r.get(c)
        if v is None:
            return "-"
        text = f"{v:.2f}"
        return bold(text) if v == best[c] else underline(text) if v == second[c] else text

    md = ["| " + " | ".join(["model", *columns]) + " |", "|" + "---|" * (len(columns) + 1)]
    esc = lambda s: s.replace("_", "\\_").replace("%", "\\%").replace("&", "\\&").replace("#", "\\#")
    tex = ["\\begin{tabular}{l" + "r" * len(columns) + "}", "\\toprule",
           " & ".join(["Model", *map(esc, columns)]) + " \\\\", "\\midrule"]
    for name, r in rows.items():
        md.append("| " + " | ".join([name, *(cell(r, c, lambda s: f"**{s}**", str) for c in columns)]) + " |")
        tex.append(" & ".join([esc(name), *(cell(r, c, lambda s: f"\\textbf{{{s}}}", lambda s: f"\\underline{{{s}}}")
                                            for c in columns)]) + " \\\\")
    tex += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(md) + "\n", "\n".join(tex) + "\n"
