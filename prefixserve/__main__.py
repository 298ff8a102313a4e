"""``python -m prefixserve``: the same as the ``prefixserve`` command."""

import sys

from prefixserve.cli import main

sys.exit(main())
