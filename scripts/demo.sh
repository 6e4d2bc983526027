#!/usr/bin/env bash
# The main job: set up (if needed), then trace a small built-in model, print its summary,
# write a graph picture and print the doctor table. No downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchlens demo "$@"
