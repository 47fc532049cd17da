#!/usr/bin/env bash
# Ops tier: the tests under tests/ops, in a fresh virtual environment, with Debian's
# prometheus package (promtool checks and unit-tests the alert rules; the server evaluates
# them against a live demo). Skips are failures here: every ops test must really run.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .ci/lib.sh

tier_name="ops tier"
work="${CI_WORK:-$(mktemp -d)}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    quietly apt-get update -qq
    # The package's service is never started by apt here (no init system); the tests start
    # their own server on loopback.
    quietly apt-get install -y -qq --no-install-recommends prometheus
fi

fresh_venv "$work/ops"
quietly python3 -m pip install torch==2.13.0 -e '.[dev]'
OMNITRACE_FORBID_SKIPS=1 python3 -m pytest -q -p no:cacheprovider tests/ops
