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
extra=()
[ -n "$torch_index" ] && extra=(--extra-index-url "$torch_index")
python3 -m pip download --dest "$out" --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any "${extra[@]}" -r "$out/requirements.txt"
echo "wheelhouse ready: $out ($(ls "$out" | wc -l) files)"
echo "install on the host: python -m pip install --no-index --find-links $out fox-train fox-eval"
