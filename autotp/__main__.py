"""``python -m autotp``: the same command line as the ``autotp`` script (`autotp.cli`)."""

import sys

from autotp.cli import main

sys.exit(main())
