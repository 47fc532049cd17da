#!/usr/bin/env bash
# vLLM conformance tier: vLLM's wheel on CPU torch, in a fresh virtual environment, so
# tests/integrations/test_vllm_conformance.py and test_vllm_plugin.py run against the real
# EncoderCudaGraphManager and plugin loader. Skips are failures here.
#
# vLLM pins a CUDA torch and dozens of serving dependencies; pip must never resolve them here
# (it would replace the CPU torch). The wheel goes in with --no-deps, then exactly the
# packages `import vllm.v1.worker.encoder_cudagraph` and a VllmConfig need on CPU
# (VLLM_TARGET_DEVICE=cpu), also with --no-deps, pinned per vLLM version below.
#
# Qwen2.5-Omni's modules also run here: transformers' audio tower on both releases, vLLM's
# vision tower on 0.33 (see the deselect below for 0.26).
#
# VLLM_VERSION picks the release (default 0.33.0, the newest); vllm-0.26.sh runs this script
# for 0.26.0, the newest release pinned to the torch 2.11 of the GPU machine where the CUDA
# tests run. docs/vllm.md lists which versions are tested where.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .ci/lib.sh

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
export VLLM_TARGET_DEVICE=cpu
work="${CI_WORK:-$(mktemp -d)}"

# What the encoder graph manager's import chain and a CPU VllmConfig need, pinned inside
# each release's own ranges.
vllm_pins() {
    case "$1" in
        0.33.0)
            echo aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
                anyio==4.11.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 \
                einops==0.8.2 fastapi==0.136.1 frozenlist==1.8.0 h11==0.16.0 \
                httpcore2==2.16.2 httpx2==2.16.2 huggingface-hub==2.4.0 llguidance==1.7.3 \
                msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 openai-harmony==0.0.8 \
                partial-json-parser==0.2.1.1.post7 pillow==13.0.0 propcache==0.5.4 \
                psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 safetensors==0.8.0 \
                starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2 \
                truststore==0.10.5 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
            ;;
        0.26.0)
            # 0.26's import chain and a CPU VllmConfig need the same packages as 0.33's,
            # and these versions sit inside both releases' ranges.
            vllm_pins 0.33.0
            ;;
        *)
            echo "vllm tier: no dependency pins for vLLM $1 in .ci/tiers/vllm.sh" >&2
            return 1
            ;;
    esac
}
pins="$(vllm_pins "$VLLM_VERSION")"

probe() {
    python3 - "$VLLM_VERSION" <<'PY'
import sys
import vllm
import vllm.v1.worker.encoder_cudagraph  # noqa: F401
from vllm.config import VllmConfig

VllmConfig()
sys.exit(0 if vllm.__version__ == sys.argv[1] else f"vLLM {vllm.__version__} imported")
PY
}

start=$SECONDS
fresh_venv "$work/vllm-$VLLM_VERSION"
pip_install() { python3 -m pip install --quiet --no-deps "$@"; }

# The README's test environment first; vLLM is imported against its CPU torch.
python3 -m pip install --quiet torch==2.13.0 -e '.[dev]'

# Base libraries vLLM imports (lower bounds only, so a version the dev extra brought is kept).
pip_install "numpy>=1.26" "pydantic>=2.12" "pydantic-core>=2.27" "annotated-types>=0.6" \
    "typing-inspection>=0.4" "typing-extensions>=4.12" "requests>=2.32" "urllib3>=2" \
    "idna>=3" "charset-normalizer>=3" "certifi>=2024" "regex>=2024" "pyyaml>=6" \
    "filelock>=3.16" "fsspec>=2024" "packaging>=24" "sniffio>=1.3" "jinja2>=3.1" \
    "markupsafe>=2.1" "cloudpickle>=2" "py-cpuinfo>=9" "prometheus-client>=0.18" \
    "protobuf>=5.29.6" "six>=1.16" "attrs>=23"
# shellcheck disable=SC2086
pip_install $pins
# The wheel itself (about 300 MB): never with its dependencies.
pip_install "vllm==$VLLM_VERSION"

# vLLM 0.26 detects its CPU platform only from a '+cpu' build tag, which PyPI's CUDA wheel
# lacks; a one-line platform plugin (vLLM's own extension point) names the CPU platform.
# Newer releases detect it from VLLM_TARGET_DEVICE and get no plugin.
if [ "${VLLM_VERSION%.*}" = "0.26" ]; then
site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$site/vllm_ci_cpu_platform.py" <<'PY'
"""vLLM platform plugin for CI machines without an accelerator: vLLM's CPU platform."""


def cpu_platform() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
PY
dist="$site/vllm_ci_cpu_platform-0.0.0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm-ci-cpu-platform\nVersion: 0.0.0\n' > "$dist/METADATA"
printf '[vllm.platform_plugins]\ncpu_ci = vllm_ci_cpu_platform:cpu_platform\n' \
    > "$dist/entry_points.txt"
: > "$dist/RECORD"
fi

if ! probe >/dev/null 2>&1; then
    echo "vllm tier: vLLM $VLLM_VERSION installed but does not import on CPU:" >&2
    probe >&2 || true
    exit 1
fi
echo "vllm tier: vLLM $VLLM_VERSION ready in $(elapsed "$start")"

deselect=()
if [ "${VLLM_VERSION%.*}" = "0.26" ]; then
    # vLLM 0.26's SiluAndMul binds torch.ops._C.silu_and_mul when it is built, and the CUDA
    # wheel has no such op on a CPU: its Qwen2.5 vision tower cannot be built here (the GPU
    # machine runs these tests' CUDA cases).
    for test in "test_vllm_vision_tower_through_the_graph_equals_its_own_forward[cpu-simulated]" \
        "test_each_tower_serves_a_calls_items_one_by_one_when_split[vision-cpu-simulated]"; do
        deselect+=(--deselect "tests/integrations/test_qwen2_5_omni_vllm_modules.py::$test")
    done
fi

# Each model's test_<model>_vllm_modules.py runs here by its name: a new one needs no line.
OMNITRACE_FORBID_SKIPS=1 python3 -m pytest -q -p no:cacheprovider ${deselect[@]+"${deselect[@]}"} \
    tests/integrations/test_vllm_conformance.py tests/integrations/test_vllm_plugin.py \
    tests/integrations/test_vllm_request_hooks.py \
    tests/integrations/test_*_vllm_modules.py
