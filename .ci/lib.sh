# Helpers sourced by .ci/run and the tier scripts.

# fresh_venv DIR: create a virtual environment nothing else has touched, and activate it.
fresh_venv() {
    python3 -m venv "$1"
    # shellcheck disable=SC1091
    . "$1/bin/activate"
}

# elapsed START: seconds since START (from $SECONDS).
elapsed() { echo "$(( SECONDS - $1 ))s"; }
