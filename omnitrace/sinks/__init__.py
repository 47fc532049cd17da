"""Event consumers: OpenTelemetry (:mod:`omnitrace.sinks.otel`), structlog JSON logs, the rich
live view (:mod:`omnitrace.sinks.live`), the JSONL log.

Each sink imports only omnitrace's events and stats (never the adapters), and its own
third-party library; nothing in the core imports a sink. A sink the environment can ask for
declares itself with a module-level ``SINK``, which :mod:`omnitrace.sinks.registry` reads
from the module's source, here or in a package under this one.
"""
