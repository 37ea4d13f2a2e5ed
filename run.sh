#!/usr/bin/env bash
# The project's two entry points, each setting up .venv first (idempotent, from requirements.txt):
#   bash run.sh quickstart [args]   # CPU-sized quickstart on embedded/offline data
#   bash run.sh test [pytest args]  # the default test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! cmp -s requirements.txt .venv/.requirements.stamp; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  # Offline-friendly first (the venv's setuptools); where that venv cannot build an editable wheel,
  # pip's isolated build. The first try's failure is expected there: not shown.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
  cp requirements.txt .venv/.requirements.stamp
fi
cmd=${1:-}; shift || true
case "$cmd" in
  quickstart) exec .venv/bin/python -m experiments.quickstart "$@" ;;
  # Two workers (CI and this project's machines have 2 cores), one test file per worker at a time
  # (files share module fixtures); FPA_TEST_WORKERS=0 runs in one process. The 25 slowest tests are
  # listed at the end, so every run shows where its time goes.
  test) exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${FPA_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@" ;;
  *) echo "usage: bash run.sh {quickstart|test} [args]" >&2; exit 2 ;;
esac
