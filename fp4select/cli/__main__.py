"""``python -m fp4select.cli``: the same command line as ``fp4select``."""

import sys

from fp4select.cli import main

sys.exit(main())
