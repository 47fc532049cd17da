"""``omnitrace completion``: the script a shell loads completes what the parser accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from omnitrace.cli import main
from omnitrace.cli.completion import completion_script
from omnitrace.cli.parser import build_parser

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _complete(tmp_path: Path, words: list[str], shell: str = "bash") -> list[str]:
    """COMPREPLY of the generated function for the command line ``words`` (last: the word
    being completed), run by bash in ``tmp_path``."""
    script = tmp_path / "completion.sh"
    script.write_text(completion_script(build_parser(), shell))
    array = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    program = (
        f"source {script}\n"
        f"COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}\n"
        "_omnitrace\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_the_first_word_completes_to_the_commands(tmp_path: Path) -> None:
    """After ``omnitrace``, every command and nothing else that starts with the prefix."""
    assert _complete(tmp_path, ["omnitrace", ""])[:8] == [
        "advise",
        "completion",
        "config",
        "demo",
        "receive",
        "replay",
        "top",
        "trace",
    ]
    assert _complete(tmp_path, ["omnitrace", "re"]) == ["receive", "replay"]


def test_a_commands_options_and_an_options_choices_complete(tmp_path: Path) -> None:
    """``top --f`` gives ``--follow``; ``receive --protocol`` its two protocols."""
    assert _complete(tmp_path, ["omnitrace", "top", "--fo"]) == ["--follow"]
    assert _complete(tmp_path, ["omnitrace", "receive", "--protocol", ""]) == [
        "http/protobuf",
        "grpc",
    ]
    assert _complete(tmp_path, ["omnitrace", "completion", ""]) == ["bash", "zsh"]


def test_other_words_complete_to_file_names(tmp_path: Path) -> None:
    """Event logs are files: a word that is no option completes to the paths it starts."""
    (tmp_path / "events-0.jsonl").write_text("")
    (tmp_path / "events-1.jsonl").write_text("")
    found = _complete(tmp_path, ["omnitrace", "top", "events-"])
    assert sorted(found) == ["events-0.jsonl", "events-1.jsonl"]


def test_the_zsh_script_loads_bashcompinit_then_the_same_function(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``completion zsh`` prints the bash function behind zsh's bashcompinit."""
    assert main(["completion", "zsh"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "autoload -U +X bashcompinit && bashcompinit"
    assert "complete -o filenames -F _omnitrace omnitrace" in out
    assert main(["completion", "bash"]) == 0
    assert "bashcompinit" not in capsys.readouterr().out


def test_a_shell_it_does_not_know_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``completion fish`` is refused by the parser; the function names the shells it knows."""
    with pytest.raises(SystemExit) as stop:
        main(["completion", "fish"])
    assert stop.value.code == 2
    assert "invalid choice: 'fish'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shell: expected one of bash, zsh, got 'fish'"):
        completion_script(build_parser(), "fish")
