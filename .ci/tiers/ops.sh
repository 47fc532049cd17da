#!/usr/bin/env bash
# Ops tier: tools the tests under tests/ops need beyond the Python dev extra.
#   promtool       (Debian's prometheus package) checks and unit-tests the alert rules;
#   promql-parser  (Prometheus's parser, Rust wheel) parses every dashboard and rule query.
# Idempotent and quiet: installs only what is missing, prints output only when a step fails.
set -euo pipefail

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
quietly() {
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "ops tier: failed: $*" >&2
        exit 1
    fi
}

if ! command -v promtool >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    quietly apt-get update -qq
    # Only promtool is used; the packaged server is never started (no init system in CI).
    quietly apt-get install -y -qq --no-install-recommends prometheus
fi

if ! python3 -c "import promql_parser" >/dev/null 2>&1; then
    quietly python3 -m pip install -q --root-user-action=ignore --only-binary=:all: \
        "promql-parser>=0.12"
fi
