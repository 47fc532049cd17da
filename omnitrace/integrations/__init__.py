"""Integrations with serving stacks: model integrations, their registry, the vLLM plugin.

``base`` holds what every model integration shares, ``registry`` finds the one for a loaded
model (one module per model beside it, and the ``omnitrace.models`` entry-point group),
``vllm_plugin`` hooks vLLM's model loader and ``worker`` names the worker process. Nothing
here imports vLLM at import time.
"""
