"""``python -m modelopt_lite``: the same command line as ``modelopt-lite``."""

import sys

from .cli import main

sys.exit(main())
