#!/usr/bin/env bash
# vLLM conformance tier: vLLM's wheel on CPU torch, so tests/integrations/test_vllm_conformance.py
# runs against the real EncoderCudaGraphManager and plugin loader.
#
# vLLM pins a CUDA torch and dozens of serving dependencies; pip must never resolve them here
# (it would replace the CPU torch). The wheel goes in with --no-deps, then exactly the
# packages `import vllm.v1.worker.encoder_cudagraph` and a VllmConfig need on CPU
# (VLLM_TARGET_DEVICE=cpu), also with --no-deps. Idempotent: a second run only checks.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.33.0"
export VLLM_TARGET_DEVICE=cpu

probe() {
    "$PYTHON" - "$VLLM_VERSION" <<'PY' >/dev/null 2>&1
import sys
import vllm
import vllm.v1.worker.encoder_cudagraph  # noqa: F401
from vllm.config import VllmConfig

VllmConfig()
sys.exit(0 if vllm.__version__ == sys.argv[1] else 1)
PY
}

if probe; then
    echo "vllm tier: vLLM $VLLM_VERSION already importable"
    exit 0
fi

start=$(date +%s)
pip_install() { "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "$@"; }

# The CPU torch the README's test command installs; vLLM is imported against it.
"$PYTHON" -m pip install --quiet --disable-pip-version-check torch==2.13.0

# Base libraries vLLM imports that the image usually has already (lower bounds only, so a
# present version is kept).
pip_install "numpy>=1.26" "pydantic>=2.12" "pydantic-core>=2.27" "annotated-types>=0.6" \
    "typing-inspection>=0.4" "typing-extensions>=4.12" "requests>=2.32" "urllib3>=2" \
    "idna>=3" "charset-normalizer>=3" "certifi>=2024" "regex>=2024" "pyyaml>=6" \
    "filelock>=3.16" "fsspec>=2024" "packaging>=24" "sniffio>=1.3" "jinja2>=3.1" \
    "markupsafe>=2.1" "cloudpickle>=2" "py-cpuinfo>=9" "prometheus-client>=0.18" \
    "protobuf>=5.29.6" "six>=1.16" "attrs>=23"

# What the encoder graph manager's import chain and a CPU VllmConfig need, pinned inside
# vLLM 0.33's own ranges.
pip_install \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
    anyio==4.11.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 einops==0.8.2 \
    fastapi==0.136.1 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
    huggingface-hub==2.4.0 llguidance==1.7.3 msgspec==0.23.0 multidict==7.2.1 \
    openai==3.57.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
    propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 safetensors==0.8.0 \
    starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2 \
    truststore==0.10.5 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1

# The wheel itself (about 340 MB): never with its dependencies.
pip_install "vllm==$VLLM_VERSION"

if ! probe; then
    echo "vllm tier: vLLM $VLLM_VERSION installed but does not import on CPU:" >&2
    "$PYTHON" -c "import vllm.v1.worker.encoder_cudagraph" >&2 || true
    exit 1
fi
echo "vllm tier: vLLM $VLLM_VERSION ready in $(( $(date +%s) - start ))s"
