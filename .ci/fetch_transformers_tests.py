"""Fetch transformers' common model tests for the installed transformers release into an ignored folder.

``packages/fox-models/tests/test_transformers_mixins.py`` runs transformers' own ``CausalLMModelTest``
(``ModelTesterMixin``, ``GenerationTesterMixin`` and the mixins beside them) on the project's models. Those
files live in the transformers repository's ``tests/``: the wheel ships none of them and the sdist only some
(``test_modeling_common.py`` without the ``generation/test_utils.py`` and ``causal_lm_tester.py`` it needs),
so they come from the release's tag on GitHub, the same release as the installed package, with its LICENSE
(Apache-2.0). No transformers code is kept in this repository.

From ``tests/causal_lm_tester.py`` on, every module a fetched file imports from the repository's own
packages is fetched too, with the packages' ``__init__.py``, into ``DEST/<version>/`` in the repository's
layout. The folder is written whole or not at all.

    uv run --locked python .ci/fetch_transformers_tests.py             # the installed release
    uv run --locked --with transformers==5.20.0 python .ci/fetch_transformers_tests.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".transformers-tests"  # ignored by git; the test module reads DEST/<version>/tests
BASE = "https://raw.githubusercontent.com/huggingface/transformers/v{version}/"
ENTRY = "tests.causal_lm_tester"
# The repository's packages the test files import, and their folders: tests/ itself, utils/ (imported from
# the repository's root as the working directory) and utils/test_module (imported after putting utils/ on
# sys.path).
PACKAGES = {"tests": "tests", "utils": "utils", "test_module": "utils/test_module"}
# Read by path, not imported: the list of the Hub's tiny models that tests/test_pipeline_mixin.py loads.
DATA = ("tests/utils/tiny_model_summary.json", "LICENSE")


def read(base: str, path: str) -> bytes | None:
    """The file at ``base + path``, or None where the release has no such file."""
    try:
        with urllib.request.urlopen(base + path, timeout=60) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    except urllib.error.URLError as error:
        if isinstance(error.reason, FileNotFoundError):  # a file:// base (a local checkout)
            return None
        raise


def imported_modules(source: bytes, package: str) -> set[str]:
    """Dotted names of the repository's modules that a module of ``package`` imports, anywhere in the file:
    ``from .x import y``, ``from ..x import y``, ``from tests.x import y``, ``import tests.x`` and
    ``from . import x`` (x a module)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                module = parts[: len(parts) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] in PACKAGES:
                module = node.module.split(".")
            else:
                continue
            if node.module:
                names.add(".".join(module))
            else:
                names.update(".".join(module + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES)
    return names


def fetch(version: str, dest: Path, base: str) -> Path:
    """Fetch the files of ``version`` into ``dest/<version>`` and return that folder."""
    base = base.format(version=version)
    files: dict[str, bytes] = {}
    queue, done = [(ENTRY, True)], set()  # (module, whether it must be a file)
    while queue:
        module, required = queue.pop()
        if module in done:
            continue
        done.add(module)
        top, *rest = module.split(".")
        stem = "/".join([PACKAGES[top], *rest])
        for path in (stem + ".py", stem + "/__init__.py"):
            source = read(base, path)
            if source is not None:
                break
        else:
            if not required:  # a package without __init__.py (a namespace package)
                continue
            raise SystemExit(f"{base}: no module {module} (neither {stem}.py nor {stem}/__init__.py); "
                             f"is {version} a transformers release?")
        files[path] = source
        parts = module.split(".")
        queue += [(".".join(parts[:i]), False) for i in range(1, len(parts))]  # the packages it lies in
        package = module if path.endswith("__init__.py") else ".".join(parts[:-1])
        queue += [(name, True) for name in imported_modules(source, package)]
    for path in DATA:
        files[path] = read(base, path)
        if files[path] is None:
            raise SystemExit(f"{base}{path} not found")
    out = dest / version
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest))
    try:
        for path, source in files.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_bytes(source)
        (tmp / "SOURCE").write_text(
            f"transformers {version}: {len(files) - 1} files of its repository from {base}, under its LICENSE "
            "(Apache-2.0); fetched by .ci/fetch_transformers_tests.py, not part of this repository\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="transformers release (default: the installed one)")
    parser.add_argument("--dest", type=Path, default=DEST, help=f"folder of the fetched releases ({DEST})")
    parser.add_argument("--base", default=BASE, help=f"URL of the release's tree, {{version}} filled in ({BASE})")
    args = parser.parse_args()
    version = args.version or importlib.metadata.version("transformers")
    try:
        out = fetch(version, args.dest, args.base)
    except (urllib.error.URLError, TimeoutError) as error:
        url = args.base.format(version=version)
        raise SystemExit(f"transformers {version}'s tests could not be fetched from {url}: {error}") from None
    print(f"transformers {version}: {sum(1 for _ in out.rglob('*.py'))} Python files in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
