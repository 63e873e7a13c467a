#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the suite (unit + in-process engines + real end-to-end) but the
# `extended` real runs, which CI's 90-minute bound on 2 cores cannot hold (a launch of the tiny model costs ≈ 160 s on a
# 2-core AVX2 Xeon: docs/measurements.md). Tiers (pyproject.toml markers):
#   bash scripts/run_tests.sh fast      # neither real runs nor vLLM engines
#   bash scripts/run_tests.sh engine    # the in-process vLLM engine tests
#   bash scripts/run_tests.sh e2e       # the real Ray + DeepSpeed + vLLM runs CI runs
#   bash scripts/run_tests.sh extended  # the real runs CI leaves out (≈ 25 min): run them before landing a change to
#                                       # what they cover (their modules' docstrings say what)
#   bash scripts/run_tests.sh all       # everything
# Any other arguments go to pytest as they are (a file, -k, -x, ...), with the extended runs left out: name a tier
# first to keep them (`all tests/test_e2e_stops.py`).
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
  e2e) shift; set -- -m "e2e and not extended" "$@" ;;
  extended) shift; set -- -m extended "$@" ;;
  all) shift ;;
  *) set -- -m "not extended" "$@" ;;
esac
cores=$(nproc)
workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [[ $workers -gt 0 ]]; then
  set -- -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
fi
exec "$ROOT/.venv/bin/python" -m pytest "$@"
