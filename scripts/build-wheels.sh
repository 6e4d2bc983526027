#!/usr/bin/env bash
# Build every member distribution of this repository into one wheelhouse, so that
#   pip install --no-index --find-links wheelhouse "torchlens[torch]"
# installs exactly the chosen parts into any virtual environment.
#
# usage: bash scripts/build-wheels.sh [WHEELHOUSE] [--with-deps EXTRA[,EXTRA...]] [--deps-dir DIR]
#
#   WHEELHOUSE              output folder (default: wheelhouse/ at the repository root)
#   --with-deps torch,jax   also download the third-party wheels those extras need
#                           (numpy, pluggy, safetensors, torch, jax, ...), pinned by
#                           constraints.txt, so the install line above works offline.
#                           Wheels already there are reused without asking an index.
#   --deps-dir DIR          put those third-party wheels in DIR instead (then pass both
#                           folders: --find-links WHEELHOUSE --find-links DIR)
#
# Why --no-index: the name "torchlens" on PyPI belongs to an unrelated project (2.x), so an
# install that may consult PyPI can pick it instead of the meta-distribution built here.
# Builds without build isolation, so the building Python needs setuptools>=64 and wheel
# (PYTHON=..., default .venv/bin/python when present, else python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="$ROOT/wheelhouse"
DEPS=""
DEPS_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --with-deps) DEPS=${2:?--with-deps needs a comma-separated list of extras}; shift 2 ;;
    --with-deps=*) DEPS=${1#--with-deps=}; shift ;;
    --deps-dir) DEPS_DIR=${2:?--deps-dir needs a folder}; shift 2 ;;
    --deps-dir=*) DEPS_DIR=${1#--deps-dir=}; shift ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    -*) echo "build-wheels: unknown option $1" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import setuptools, wheel" 2>/dev/null; then
  echo "build-wheels: $PYTHON lacks setuptools/wheel (pip install 'setuptools>=64' wheel)" >&2
  exit 2
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The meta-distribution (repository root) and every member distribution.
MEMBERS=". packages/torchlens-core packages/torchlens-torch packages/torchlens-jax packages/torchlens-mlx packages/torchlens-tf packages/torchlens-paddle packages/torchlens-tinygrad packages/torchlens-mechinterp packages/torchlens-reference conformance"
# Build from a copy of each member's sources: setuptools writes build/ and *.egg-info next to
# the sources, which must not land in the working tree (and must not leak between members).
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
for m in $MEMBERS; do
  src="$ROOT/$m"
  [ -f "$src/pyproject.toml" ] || { echo "build-wheels: $m is not in this checkout; skipped" >&2; continue; }
  dst="$STAGE/$(echo "$m" | tr '/.' '__')"
  mkdir -p "$dst"
  if [ "$m" = "." ]; then
    cp "$src/pyproject.toml" "$src/README.md" "$dst/"
  else
    (cd "$src" && tar --exclude=./build --exclude=./dist --exclude=./tests --exclude='*.egg-info' --exclude=__pycache__ -cf - .) \
      | (cd "$dst" && tar -xf -)
  fi
  # PEP 517 build through setuptools directly (what `pip wheel --no-build-isolation` does,
  # without pip's start-up cost).
  (cd "$dst" && "$PYTHON" -c 'import sys; from setuptools import build_meta as b; b.build_wheel(sys.argv[1])' "$OUT") \
    >"$STAGE/build.log" 2>&1 || { cat "$STAGE/build.log" >&2; echo "build-wheels: building $m failed" >&2; exit 1; }
done
if [ -n "$DEPS" ]; then
  # Third-party requirements of the chosen extras, read from the wheels just built
  # (never resolved against an index: the torchlens names there are not ours).
  reqs=$("$PYTHON" - "$OUT" "$DEPS" <<'EOF'
import re, sys, zipfile
from pathlib import Path

out, extras = Path(sys.argv[1]), {e.strip() for e in sys.argv[2].split(",") if e.strip()}
meta = {}
for whl in out.glob("torchlens*.whl"):
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(name).decode().splitlines()
    dist = next(l.split(":", 1)[1].strip() for l in lines if l.startswith("Name:"))
    meta[dist.lower().replace("_", "-")] = [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:")]
wanted, todo, seen = [], [("torchlens", extras)], set()
while todo:
    dist, chosen = todo.pop()
    if (dist, tuple(sorted(chosen))) in seen or dist not in meta:
        continue
    seen.add((dist, tuple(sorted(chosen))))
    for req in meta[dist]:
        spec, _, marker = req.partition(";")
        m = re.fullmatch(r'\s*extra\s*==\s*"([^"]+)"\s*', marker) if marker else None
        if marker and (m is None or m.group(1) not in chosen):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip()).group(0).lower().replace("_", "-")
        sub = re.search(r"\[([^\]]*)\]", spec)
        sub_extras = {e.strip() for e in sub.group(1).split(",")} if sub else set()
        if name.startswith("torchlens"):
            if name == "torchlens" or name in meta:
                todo.append((name, sub_extras))
            else:
                sys.exit(f"build-wheels: extra needs {name}, which this repository does not build")
        else:
            wanted.append(spec.strip())
print("\n".join(sorted(set(wanted))))
EOF
)
  if [ -n "$reqs" ]; then
    DEPS_DIR=${DEPS_DIR:-$OUT}
    mkdir -p "$DEPS_DIR"
    mapfile -t reqlist <<<"$reqs"
    # Offline first: a second run with the same pins downloads (and asks) nothing.
    "$PYTHON" -m pip download -q --no-index --find-links "$DEPS_DIR" -c "$ROOT/constraints.txt" -d "$DEPS_DIR" \
        "${reqlist[@]}" >/dev/null 2>&1 \
      || "$PYTHON" -m pip download -q -c "$ROOT/constraints.txt" -d "$DEPS_DIR" "${reqlist[@]}"
  fi
fi
echo "build-wheels: wheels in $OUT${DEPS_DIR:+ (third-party wheels in $DEPS_DIR)}"
