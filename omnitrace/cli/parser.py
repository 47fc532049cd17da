"""The ``omnitrace`` command's argument parser: each command adds its own, from its module; it
imports only what ``--help`` and argument errors need, so the command line answers at once."""

from __future__ import annotations

import argparse

from omnitrace._version import __version__
from omnitrace.cli.advise import add_advise_parser
from omnitrace.cli.completion import add_completion_parser
from omnitrace.cli.config import add_config_parser
from omnitrace.cli.demo import add_demo_parser
from omnitrace.cli.options import HelpFormatter
from omnitrace.cli.output import PROG
from omnitrace.cli.receive import add_receive_parser
from omnitrace.cli.replay import add_replay_parser
from omnitrace.cli.top import add_top_parser
from omnitrace.cli.trace import add_trace_parser

__all__ = ["HELP_EPILOGS", "build_parser"]


_OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (any one turns the OTLP export on), "
    "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, "
    "OTEL_METRIC_EXPORT_INTERVAL, OTEL_BSP_SCHEDULE_DELAY"
)
#: Each command's help ends with the variables it reads (None: none of omnitrace's) and the
#: section of the documentation about it.
HELP_EPILOGS: dict[str, tuple[str | None, str]] = {
    "demo": (
        f"{_OTEL_VARIABLES}; RANK and LOCAL_RANK (the rank in the event log's name)",
        "docs/operations.md, 'Quick start: `omnitrace demo`'",
    ),
    "top": (None, "docs/operations.md, 'Following a serving process: `omnitrace top`'"),
    "replay": (
        f"{_OTEL_VARIABLES}; OMNITRACE_LOGS and OMNITRACE_SUMMARY_INTERVAL (JSON log lines)",
        "docs/operations.md, 'Replaying a recorded run: `omnitrace replay`' and 'Exporting "
        "beside the server: `omnitrace replay --follow`'",
    ),
    "advise": (None, "docs/operations.md, 'Choosing settings: `omnitrace advise`'"),
    "receive": (None, "docs/telemetry.md, 'Checking the exporter settings: `omnitrace receive`'"),
    "trace": (None, "docs/operations.md, 'Why is my TTFT high?'"),
    "config": (
        "every OMNITRACE_* and OTEL_* variable it lists",
        "docs/operations.md, 'What is in force: `omnitrace config`'",
    ),
    "completion": (None, "docs/operations.md, 'Shell completion'"),
}


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command's parser, each with its handler (``handler``) and the
    whole parser (``root_parser``, which ``completion`` reads) as defaults."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Observable exact-shape CUDA graphs for multimodal encoders.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.set_defaults(root_parser=parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_demo_parser,
        add_top_parser,
        add_replay_parser,
        add_advise_parser,
        add_receive_parser,
        add_trace_parser,
        add_config_parser,
        add_completion_parser,
    ):
        add(commands)
    for name, (environment, docs) in HELP_EPILOGS.items():
        read = environment or "none of omnitrace's variables"
        commands.choices[name].epilog = f"environment: {read}. docs: {docs}."
    return parser
