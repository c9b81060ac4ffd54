"""``python -m flexspec``: the same as the ``flexspec`` command."""

import sys

from flexspec.tools.cli import main

sys.exit(main())
