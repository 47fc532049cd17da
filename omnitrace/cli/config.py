"""``omnitrace config``: every setting in force (encoder graph keys, the plugin's variables, the
OTLP export), its value and where it came from; nothing is started or sent."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import omnitrace.cli.options as opt
from omnitrace.cli.output import PROG, _print_json

__all__ = ["_cmd_config", "add_config_parser", "settings"]
#: The service name of the plugin's workers when no OpenTelemetry variable gives one.
DEFAULT_SERVICE_NAME = "omnitrace"


def add_config_parser(commands: Any) -> None:
    """Add ``config`` to the command line's subcommands."""
    command = commands.add_parser(
        "config",
        help="print every setting in force, with its value and where it came from",
        description=(
            "Print, for this environment and the given --hf-overrides, every omnitrace "
            "setting with its value and source (default, override, --enforce-eager or the "
            "environment variable): the encoder graph settings, the vLLM plugin's OMNITRACE_* "
            "variables, and the OTLP protocol, service name and endpoint of each signal "
            "(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and _METRICS_ENDPOINT over "
            "OTEL_EXPORTER_OTLP_ENDPOINT, as OpenTelemetry specifies). A value omnitrace would "
            "refuse makes the exit status 2. See README.md, 'Configuration', and "
            "docs/operations.md, 'Sinks from the environment'."
        ),
        formatter_class=opt.HelpFormatter,
    )
    command.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="encoder graph settings as vLLM takes them, e.g. "
        "'{\"encoder_cuda_graph_max_graphs\": 8}'",
    )
    command.add_argument(
        "--enforce-eager", action="store_true", help="as vLLM's flag: encoder graphs off"
    )
    command.add_argument("--json", action="store_true", help="print the settings as JSON")
    command.set_defaults(handler=_cmd_config)


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: its value, where the value came from, and why it is invalid, if it is."""

    group: str
    name: str
    value: Any
    source: str
    """``default``, ``override``, ``enforce_eager`` or ``environment``."""
    variable: str | None = None
    """The variable that set the value (``environment`` only)."""
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = {"group": self.group, "name": self.name, "value": self.value}
        data.update(source=self.source, variable=self.variable)
        if self.error is not None:
            data["error"] = self.error
        return data


def _from_env(
    group: str, name: str, environ: Mapping[str, str], read: Callable[[], Any], blank_unset: bool
) -> Setting:
    """The setting the variable ``name`` gives, read by ``read`` (which may refuse it)."""
    from omnitrace.errors import ConfigError

    raw = environ.get(name)
    given = raw is not None and (raw.strip() != "" or not blank_unset)
    source, variable = ("environment", name) if given else ("default", None)
    try:
        return Setting(group, name, read(), source, variable)
    except ConfigError as exc:
        return Setting(group, name, raw, source, variable, error=str(exc))


def _encoder_settings(
    overrides: str | None, enforce_eager: bool, warn: Callable[[str], None]
) -> tuple[list[Setting], str | None]:
    """The encoder graph settings, or the one error that refuses the overrides."""
    from omnitrace.config import (
        HF_OVERRIDE_KEYS,
        ConfigError,
        EncoderGraphConfig,
        parse_hf_overrides,
    )

    try:
        if overrides is not None and not overrides.strip():
            raise ConfigError(
                "expected a JSON object, e.g. '{\"encoder_cuda_graph_max_graphs\": 8}', got "
                f"{overrides!r} (leave the option out for the defaults)"
            )
        given = parse_hf_overrides(overrides)
        config = EncoderGraphConfig.from_hf_overrides(given, enforce_eager=enforce_eager, warn=warn)
    except ConfigError as exc:
        return [], f"--hf-overrides: {exc}"
    rows = []
    for key, field_name in HF_OVERRIDE_KEYS.items():
        value = getattr(config, field_name)
        if field_name == "enabled" and enforce_eager:
            source = "enforce_eager"  # whatever the override said
        else:
            source = "override" if key in given else "default"
        rows.append(Setting("encoder graphs", key, value, source))
    return rows, None


def _plugin_settings(environ: Mapping[str, str]) -> list[Setting]:
    from omnitrace._env import env_flag, env_seconds
    from omnitrace.integrations.vllm_plugin import ENV_PLUGIN
    from omnitrace.integrations.vllm_requests import ENV_REQUESTS
    from omnitrace.sinks.logs import ENV_SUMMARY_INTERVAL, SUMMARY_INTERVAL_RANGE
    from omnitrace.sinks.registry import SINKS

    group = "vLLM plugin"
    rows = [
        _from_env(group, ENV_PLUGIN, environ, lambda: env_flag(environ, ENV_PLUGIN, True), False)
    ]
    for spec in SINKS:
        if spec.switch:

            def read(name: str = spec.env) -> Any:
                return env_flag(environ, name, False)

        else:

            def read(name: str = spec.env) -> Any:
                return environ.get(name, "").strip() or None

        rows.append(_from_env(group, spec.env, environ, read, not spec.switch))
    rows.append(
        _from_env(
            group,
            ENV_SUMMARY_INTERVAL,
            environ,
            lambda: env_seconds(environ, ENV_SUMMARY_INTERVAL, 60.0, **SUMMARY_INTERVAL_RANGE),
            True,
        )
    )
    rows.append(
        _from_env(
            group, ENV_REQUESTS, environ, lambda: env_flag(environ, ENV_REQUESTS, True), False
        )
    )
    return rows


def _otlp_settings(environ: Mapping[str, str]) -> list[Setting]:
    # The lookup the SDK wiring, the demo and replay use: config cannot show other endpoints.
    from omnitrace._env import OTLP_SIGNALS, otlp_endpoint
    from omnitrace.errors import ConfigError
    from omnitrace.sinks.otel import OTLP_PROTOCOLS

    group = "OTLP export"

    def protocol_of() -> str:
        text = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "http/protobuf"
        if text not in OTLP_PROTOCOLS:
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL: expected one of {', '.join(OTLP_PROTOCOLS)}, "
                f"got {text!r}"
            )
        return text

    protocol = _from_env(group, "OTEL_EXPORTER_OTLP_PROTOCOL", environ, protocol_of, True)
    service, variable = _service_name(environ)
    rows = [
        protocol,
        Setting(
            group,
            "OTEL_SERVICE_NAME",
            service,
            "default" if variable is None else "environment",
            variable,
        ),
    ]
    kind = protocol.value if protocol.error is None else "http/protobuf"
    for signal in OTLP_SIGNALS:
        name = f"{signal} endpoint"
        try:
            endpoint = otlp_endpoint(environ, kind, signal)
        except ConfigError as exc:
            rows.append(Setting(group, name, None, "environment", error=str(exc)))
            continue
        source = "default" if endpoint.source is None else "environment"
        rows.append(Setting(group, name, endpoint.url, source, endpoint.source))
    return rows


def _service_name(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The service name the SDK's resource gets, and the variable that gave it (None: the
    plugin's default): ``OTEL_SERVICE_NAME``, else ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``."""
    from urllib.parse import unquote

    name = environ.get("OTEL_SERVICE_NAME", "").strip()
    if name:
        return name, "OTEL_SERVICE_NAME"
    for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = pair.partition("=")
        if key.strip() == "service.name" and value.strip():
            return unquote(value.strip()), "OTEL_RESOURCE_ATTRIBUTES"
    return DEFAULT_SERVICE_NAME, None


def _variable_warnings(environ: Mapping[str, str], known: set[str]) -> list[str]:
    """A line per ``OMNITRACE_*`` variable that is set, unknown and close to a known one."""
    lines = []
    for name in sorted(environ):
        if not name.startswith("OMNITRACE_") or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)
        if close:
            lines.append(f"{name}: not an omnitrace variable; did you mean {close[0]}?")
    return lines


def settings(
    environ: Mapping[str, str], overrides: str | None = None, *, enforce_eager: bool = False
) -> dict[str, Any]:
    """Return every setting in force, the warnings and the errors, as ``--json`` prints them."""
    warnings: list[str] = []
    rows, error = _encoder_settings(
        overrides, enforce_eager, lambda m: warnings.append(f"--hf-overrides: {m}")
    )
    rows += _plugin_settings(environ) + _otlp_settings(environ)
    from omnitrace._env import otlp_endpoint_errors

    errors = [error] if error is not None else []
    # One line per problem: a bad base endpoint is the error of both signals; one a
    # signal's own variable hides is refused by the commands all the same.
    errors += dict.fromkeys(row.error for row in rows if row.error is not None)
    protocol = next(
        (r.value for r in rows if r.name == "OTEL_EXPORTER_OTLP_PROTOCOL" and r.error is None),
        "http/protobuf",
    )
    errors += [e for e in otlp_endpoint_errors(environ, protocol) if e not in errors]
    known = {row.name for row in rows if row.name.startswith("OMNITRACE_")}
    warnings += _variable_warnings(environ, known)
    return {
        "settings": [row.as_dict() for row in rows],
        "warnings": warnings,
        "errors": errors,
    }


def _shown(value: Any) -> str:
    import json

    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _source(row: Mapping[str, Any]) -> str:
    source = str(row["source"])
    if source == "override":
        return "--hf-overrides"
    if source == "enforce_eager":
        return "--enforce-eager"
    if row["variable"] is not None:
        return str(row["variable"])
    return source


def _cmd_config(args: argparse.Namespace) -> int:
    from omnitrace._display import safe

    report = settings(os.environ, args.hf_overrides, enforce_eager=args.enforce_eager)
    if args.json:
        _print_json(report)
    else:
        rows = report["settings"]
        width = max(len(row["name"]) for row in rows)
        values = [safe(_shown(row["value"])) if "error" not in row else "invalid" for row in rows]
        value_width = min(max(len(value) for value in values), 48)
        group = None
        for row, value in zip(rows, values, strict=True):
            if row["group"] != group:
                group = row["group"]
                print(("" if group == rows[0]["group"] else "\n") + f"{group}:")
            print(f"  {row['name']:<{width}}  {value:<{value_width}}  {_source(row)}".rstrip())
    for line in report["warnings"]:
        print(f"{PROG}: warning: {safe(line)}", file=sys.stderr)
    for line in report["errors"]:
        print(f"{PROG} config: error: {safe(line)}", file=sys.stderr)
    sys.stderr.flush()
    return 2 if report["errors"] else 0
