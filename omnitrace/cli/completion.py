"""``omnitrace completion bash|zsh``: a shell completion script made from the parser itself, so
it cannot drift from the command line (``eval "$(omnitrace completion bash)"``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import omnitrace.cli.options as opt

__all__ = ["add_completion_parser", "completion_script"]

SHELLS = ("bash", "zsh")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(
    parser: argparse.ArgumentParser,
) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """A command's option strings, the choices of those that take a fixed set, and the
    choices of its positional arguments."""
    options: list[str] = []
    choices: dict[str, list[str]] = {}
    positional: list[str] = []
    for action in parser._actions:
        strings = [s for s in action.option_strings if s.startswith("-")]
        options += strings
        if action.choices is None or isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            positional += [str(c) for c in action.choices]
        elif action.nargs != 0:
            for string in strings:
                choices[string] = [str(c) for c in action.choices]
    return sorted(options), choices, positional


def _case_arm(patterns: str, body: str) -> str:
    return f"        {patterns}) {body} ;;"


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser``'s program for ``shell`` (``bash`` or ``zsh``).

    Raises:
        ValueError: ``shell`` is not one of :data:`SHELLS`.
    """
    if shell not in SHELLS:
        raise ValueError(f"shell: expected one of {', '.join(SHELLS)}, got {shell!r}")
    prog = parser.prog
    function = "_" + "".join(c if c.isalnum() else "_" for c in prog)
    commands = _subcommands(parser)
    top_options, _, _ = _options(parser)
    command_arms = []
    choice_arms = []
    for name, command in sorted(commands.items()):
        options, choices, positional = _options(command)
        words = shlex.quote(" ".join(options))
        given = f" values={shlex.quote(' '.join(positional))}" if positional else ""
        command_arms.append(_case_arm(shlex.quote(name), f"opts={words}{given}"))
        for option, values in sorted(choices.items()):
            pattern = shlex.quote(f"{name} {option}")
            choice_arms.append(_case_arm(pattern, f"choices={shlex.quote(' '.join(values))}"))
    names = shlex.quote(" ".join(sorted(commands)))
    top = shlex.quote(" ".join(top_options))
    lines = [
        f"# {shell} completion for {prog}, made by `{prog} completion {shell}`.",
    ]
    if shell == "zsh":
        lines += ["autoload -U +X bashcompinit && bashcompinit"]
    lines += [
        f"{function}() {{",
        '    local cur prev command="" opts="" choices="" values="" i',
        '    cur="${COMP_WORDS[COMP_CWORD]}"',
        '    prev="${COMP_WORDS[COMP_CWORD-1]}"',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in',
        "            -*) ;;",
        '            *) command="${COMP_WORDS[i]}"; break ;;',
        "        esac",
        "    done",
        '    if [ -z "$command" ]; then',
        f'        COMPREPLY=($(compgen -W {names}" "{top} -- "$cur"))',
        "        return 0",
        "    fi",
        '    case "$command $prev" in',
        *choice_arms,
        "    esac",
        '    if [ -n "$choices" ]; then',
        '        COMPREPLY=($(compgen -W "$choices" -- "$cur"))',
        "        return 0",
        "    fi",
        '    case "$command" in',
        *command_arms,
        "    esac",
        '    if [[ "$cur" == -* ]]; then',
        '        COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        '    elif [ -n "$values" ]; then',
        '        COMPREPLY=($(compgen -W "$values" -- "$cur"))',
        "    else",
        '        COMPREPLY=($(compgen -f -- "$cur"))',
        "    fi",
        "    return 0",
        "}",
        f"complete -o filenames -F {function} {shlex.quote(prog)}",
    ]
    return "\n".join(lines) + "\n"


def add_completion_parser(commands: Any) -> None:
    """Add ``completion SHELL`` to the command line's subcommands."""
    command = commands.add_parser(
        "completion",
        help="print a bash or zsh completion script for omnitrace",
        description=(
            "Print a completion script for the shell: commands, their options and the "
            'choices of options. Load it with eval "$(omnitrace completion bash)" in '
            '~/.bashrc, or eval "$(omnitrace completion zsh)" in ~/.zshrc.'
        ),
        formatter_class=opt.HelpFormatter,
    )
    command.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    command.set_defaults(handler=_cmd_completion)


def _cmd_completion(args: argparse.Namespace) -> int:
    # The whole command line's parser: build_parser sets it as every command's default.
    sys.stdout.write(completion_script(args.root_parser, args.shell))
    return 0
