"""``python -m flexspec``: the same as the ``flexspec`` command."""

import sys

from .cli import main

sys.exit(main())
