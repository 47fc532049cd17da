#!/usr/bin/env bash
# vLLM 0.26.0 conformance tier: the same tests as vllm.sh, against the newest vLLM release
# pinned to torch 2.11 (the GPU machine's), which drives the older encoder graph protocol.
set -euo pipefail
VLLM_VERSION=0.26.0 exec bash "$(dirname "$0")/vllm.sh"
