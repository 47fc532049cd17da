"""``python -m omnitrace.cli``: the ``omnitrace`` command (as ``python -m omnitrace``)."""

from __future__ import annotations

import sys

from omnitrace.cli import main

sys.exit(main())
