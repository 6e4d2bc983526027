#!/usr/bin/env bash
# Create .venv/ (when missing) and install every member distribution editable into it.
# Idempotent: a second run with unchanged requirements returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -q && apt-get install -y -q graphviz) >/dev/null 2>&1 \
      || echo "setup: could not install graphviz (drawings fall back to DOT text)" >&2
  else
    echo "setup: graphviz 'dot' not found; install it for rendered drawings (apt-get install graphviz)" >&2
  fi
fi
# Headless Chromium renders the notebook HTML in the browser test (it skips without it).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 \
      || echo "setup: could not install chromium (the notebook browser test will skip)" >&2
  else
    echo "setup: chromium not found; install it for the notebook browser test (apt-get install chromium)" >&2
  fi
fi
# tinygrad's CPU device compiles kernels with clang (without it the tinygrad tests use its
# pure-Python device and say so).
if ! command -v clang >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -q && apt-get install -y -q clang) >/dev/null 2>&1 \
      || echo "setup: could not install clang (tinygrad falls back to its Python device)" >&2
  else
    echo "setup: clang not found; install it for tinygrad's CPU device (apt-get install clang)" >&2
  fi
fi
MEMBERS="packages/torchlens-core packages/torchlens-torch packages/torchlens-jax packages/torchlens-reference packages/torchlens-mlx packages/torchlens-recipes-example packages/torchlens-tf packages/torchlens-paddle packages/torchlens-tinygrad packages/torchlens-mechinterp conformance"
stamp=.venv/.torchlens-setup
want=$(cat constraints.txt requirements-dev.txt requirements-vision.txt $(for m in $MEMBERS; do echo "$m/pyproject.toml"; done) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -c constraints.txt -r requirements-dev.txt
editables=()
for m in $MEMBERS; do editables+=(-e "$m"); done
.venv/bin/python -m pip install -q -c constraints.txt --no-build-isolation --no-deps "${editables[@]}"
# torchvision/timm live outside site-packages (see requirements-vision.txt for why); only
# torchlens_torch.vision_env puts .venv/vision on sys.path.
rm -rf .venv/vision
.venv/bin/python -m pip install -q -c constraints.txt --no-deps --target .venv/vision -r requirements-vision.txt
echo "$want" > "$stamp"
