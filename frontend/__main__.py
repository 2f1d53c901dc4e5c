"""``python -m frontend`` (and ``python -m frontend demo``)."""

import sys

from frontend.cli import main

sys.exit(main())
