#!/usr/bin/env bash
# The whole test suite: set up (if needed), then every package's tests, the conformance
# suite and the docs examples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
