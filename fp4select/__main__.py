import sys

from fp4select.cli import main

sys.exit(main())
