#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (unit + in-process engines + real end-to-end).
# Tiers for the inner loop (pyproject.toml markers):
#   bash scripts/run_tests.sh fast      # neither real runs nor vLLM engines (about 3 minutes)
#   bash scripts/run_tests.sh engine    # the in-process vLLM engine tests
#   bash scripts/run_tests.sh e2e       # the real Ray + DeepSpeed + vLLM runs
# Any other arguments go to pytest as they are (a file, -k, -x, ...).
# pytest-xdist runs the modules on TEST_WORKERS processes (default: one per core, at most 4), a module per worker at
# a time so that a module's real run is shared by its tests; the modules with real runs go one after another on one
# worker, started first, then the browser modules (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
case "${1:-}" in
  fast) shift; set -- -m "not e2e and not engine" "$@" ;;
  engine) shift; set -- -m "engine and not e2e" "$@" ;;
  e2e) shift; set -- -m e2e "$@" ;;
esac
cores=$(nproc)
workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [[ $workers -gt 0 ]]; then
  set -- -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
fi
exec "$ROOT/.venv/bin/python" -m pytest "$@"
