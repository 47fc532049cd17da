"""``python -m omnitrace`` runs the command-line interface."""

import sys

from omnitrace.cli import main

sys.exit(main())
