"""Event consumers: OpenTelemetry (:mod:`omnitrace.sinks.otel`), structlog JSON logs, the rich
live view (:mod:`omnitrace.sinks.live`) and the JSONL event log, each declaring itself to
:mod:`omnitrace.sinks.registry` (docs/architecture.md, "The sinks")."""
