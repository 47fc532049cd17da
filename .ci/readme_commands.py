"""Print the README's set-up commands (the bash blocks of its Quick start), one per line.

CI runs exactly these lines, so the README cannot drift from what CI proves.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands(text: str) -> list[str]:
    """Return the bash blocks of the README's Quick start section, in order."""
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", quick, re.S)


if __name__ == "__main__":
    found = commands(README.read_text(encoding="utf-8"))
    if len(found) != 2 or any("\n" in command for command in found):
        sys.exit(f"README.md: expected two one-line set-up commands in Quick start, got {found!r}")
    print("\n".join(found))
