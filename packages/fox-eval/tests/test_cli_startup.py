"""Importing fox-eval's command line loads neither torch nor transformers (``test_cli.py`` checks ``--help``
and argument errors the same way)."""

import subprocess
import sys


def test_importing_the_cli_imports_no_torch(tmp_path):
    code = "import fox_eval.cli, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
