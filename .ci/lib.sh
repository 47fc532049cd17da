# Helpers sourced by .ci/run and the tier scripts.

# fresh_venv DIR: create a virtual environment nothing else has touched, and activate it.
fresh_venv() {
    python3 -m venv "$1"
    # shellcheck disable=SC1091
    . "$1/bin/activate"
}

# elapsed START: seconds since START (from $SECONDS).
elapsed() { echo "$(( SECONDS - $1 ))s"; }

# quietly CMD...: run CMD with its output in the file $log; if it fails, print that output and
# "$tier_name: failed: CMD" and exit. A tier sets log and tier_name.
quietly() {
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "$tier_name: failed: $*" >&2
        exit 1
    fi
}
