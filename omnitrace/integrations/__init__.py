"""Integrations with serving stacks: MiniCPM-o models, the vLLM plugin, worker identity.

Nothing here imports vLLM at import time.
"""
