"""Integrations with serving stacks: model integrations (``base``), their registry, the vLLM
plugin and the worker's identity; nothing here imports vLLM at import time."""
