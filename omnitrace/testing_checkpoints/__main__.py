"""``python -m omnitrace.testing_checkpoints``: write a tiny checkpoint directory."""

from __future__ import annotations

import sys

from omnitrace.testing_checkpoints import main

sys.exit(main())
