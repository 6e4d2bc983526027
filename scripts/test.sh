#!/usr/bin/env bash
# The whole test suite: set up (if needed), check every installed backend's shipped
# scorecard against a fresh computation, then run every package's tests, the conformance
# suite and the docs examples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for backend in $(.venv/bin/python -c "import torchlens as tl; print(' '.join(sorted(tl.backends.specs())))"); do
  .venv/bin/python -m torchlens_conformance.scorecard --backend "$backend" --check
done
exec .venv/bin/python -m pytest -q "$@"
