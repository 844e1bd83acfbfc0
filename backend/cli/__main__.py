"""``python -m backend.cli``: the ``kvpool`` command."""

import sys

from backend.cli import main

sys.exit(main())
