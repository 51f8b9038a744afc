#!/usr/bin/env bash
# Build a wheelhouse of the project and every dependency for a GPU host without internet.
#
#   bash scripts/build_wheelhouse.sh [PYTHON_VERSION] [TORCH_INDEX] [OUT]
#   e.g. bash scripts/build_wheelhouse.sh 3.11 https://download.pytorch.org/whl/cu126 wheelhouse
#
# PYTHON_VERSION: the target host's Python (default 3.11). TORCH_INDEX: an extra index for a torch
# build of a given CUDA (default: PyPI's build). Copy OUT to the host and install with only it:
#
#   python -m pip install --no-index --find-links wheelhouse fox-train fox-eval
set -euo pipefail
py=${1:-3.11}
torch_index=${2:-}
out=${3:-wheelhouse}
cd "$(dirname "$0")/.."
mkdir -p "$out"
# The five packages themselves.
for pkg in fox-kernel fox-layers fox-models fox-train fox-eval; do
  uv build --package "$pkg" --wheel --out-dir "$out" --quiet
done
# Their pinned dependencies, from the lock (workspace members excluded), as Linux x86-64 wheels.
uv export --frozen --all-packages --no-dev --no-hashes --no-emit-workspace --python "$py" \
  --format requirements-txt > "$out/requirements.txt"
# Packages published only as source (no wheel in the lock, e.g. antlr4-python3-runtime 4.9.3 under
# hydra/omegaconf) are built into wheels here; they are pure Python, so the wheels fit any target.
python3 - "$out/requirements.txt" <<'PY'
import re, sys, tomllib
lock = tomllib.load(open("uv.lock", "rb"))
sdist_only = {p["name"] for p in lock["package"] if "sdist" in p and not p.get("wheels")}
req = sys.argv[1]
lines = open(req).read().splitlines()
name = lambda line: re.split(r"[=<>!~;\s\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
keep = [l for l in lines if not l.strip() or l.lstrip().startswith("#") or name(l) not in sdist_only]
build = [l.split(";")[0].strip() for l in lines if l.strip() and not l.lstrip().startswith("#") and name(l) in sdist_only]
open(req, "w").write("\n".join(keep) + "\n")
open(req.replace(".txt", "-source.txt"), "w").write("\n".join(build) + "\n")
PY
if [ -s "$out/requirements-source.txt" ]; then
  python3 -m pip wheel --no-deps --wheel-dir "$out" -r "$out/requirements-source.txt"
fi
extra=()
[ -n "$torch_index" ] && extra=(--extra-index-url "$torch_index")
# Every manylinux tag a glibc-2.34 host (RHEL 9 / Ubuntu 22.04 and newer) accepts.
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64
           --platform linux_x86_64 --platform any)
for minor in $(seq 5 34); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
python3 -m pip download --dest "$out" --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${platforms[@]}" "${extra[@]}" -r "$out/requirements.txt"
echo "wheelhouse ready: $out ($(ls "$out" | wc -l) files)"
echo "install on the host: python -m pip install --no-index --find-links $out fox-train fox-eval"
