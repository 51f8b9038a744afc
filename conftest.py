"""Workspace-wide test hooks:

* tests marked ``gpu`` are skipped on a machine without a CUDA GPU, whichever package's tests are run;
* the Triton kernels' tests through the interpreter (``packages/fox-kernel/tests/test_interpreted.py``, a
  single-threaded subprocess of ~20 minutes on a 2-core machine) start as soon as collection ends and run
  beside the rest of the suite; their test is moved last and waits for that subprocess.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

INTERPRETED_TEST = "test_interpreted.py::test_triton_kernels_in_the_interpreter"
KERNEL_TESTS = Path(__file__).parent / "packages" / "fox-kernel" / "tests"
INTERPRETED_FILES = ("test_forgetting_attention.py", "test_decode.py", "test_zero_and_nan_gates.py", "test_window.py",
                     "test_prologue.py", "test_zero_flags.py")
INTERPRETED_RUN = pytest.StashKey[tuple]()
"""(subprocess.Popen, path of its output) of the interpreted kernel tests, once started."""


def start_interpreted_kernel_tests() -> tuple:
    """The kernel test files again under TRITON_INTERPRET=1, in a fresh process (the interpreter must be on
    before Triton kernels are defined), its output in a temporary file."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    log = Path(tempfile.mkstemp(prefix="fox-interpreted-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(KERNEL_TESTS / f) for f in INTERPRETED_FILES)],
            env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )
    return proc, log


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    interpreted = [item for item in items if item.nodeid.endswith(INTERPRETED_TEST)]
    if (interpreted and os.environ.get("TRITON_INTERPRET") != "1" and not config.option.collectonly
            and not any(m.name == "skip" or (m.name == "skipif" and any(m.args))
                        for m in interpreted[0].iter_markers())):
        items.remove(interpreted[0])
        items.append(interpreted[0])
        config.stash[INTERPRETED_RUN] = start_interpreted_kernel_tests()


@pytest.fixture
def interpreted_kernel_run(request):
    """(Popen, output path) of the interpreted kernel tests: the one started after collection, or a new one."""
    return request.config.stash.get(INTERPRETED_RUN, None) or start_interpreted_kernel_tests()


def pytest_unconfigure(config):
    """A run stopped early (Ctrl-C, -x) does not leave the interpreted tests running."""
    run = config.stash.get(INTERPRETED_RUN, None)
    if run is not None and run[0].poll() is None:
        run[0].kill()
        run[0].wait()


# Runs a CLI module as `python -m MODULE ARGS` does (runpy, __main__) in a fresh interpreter, then reports its
# exit code and which of the given heavy modules it imported.
_CLI_RUN = """
import json, runpy, sys
module, prog, args, heavy = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
sys.argv = [prog, *args]
code = None
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(json.dumps({"exit": code if code is None or isinstance(code, int) else str(code),
                  "heavy": sorted(m for m in heavy if m in sys.modules)}))
"""


@pytest.fixture
def run_cli():
    """``run_cli(module, prog, heavy, args, cwd)`` -> ({"exit": code, "heavy": imported heavy modules}, output) of
    ``python -m module args`` run in ``cwd``, ``sys.argv[0]`` being ``prog``."""
    import json

    def run(module, prog, heavy, args, cwd):
        r = subprocess.run([sys.executable, "-c", _CLI_RUN, module, prog, json.dumps(args), json.dumps(list(heavy))],
                           capture_output=True, text=True, cwd=cwd, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr

    return run
