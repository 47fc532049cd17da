"""Event consumers: OpenTelemetry, structlog JSON logs, the rich live view, the JSONL log.

Each sink imports only omnitrace's events and stats (never the adapters), and its own
third-party library; nothing in the core imports a sink.
"""
