"""Integrations with serving stacks: model integrations, their registry, the vLLM plugin.

``base`` holds what every model integration shares, ``registry`` finds the one for a loaded
model (the ``omnitrace.models`` entry-point group, one module per model beside it),
``vllm_plugin`` hooks vLLM's model loader and ``worker`` names the worker process. Nothing
here imports vLLM at import time.
"""
