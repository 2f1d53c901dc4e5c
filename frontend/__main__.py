"""``python -m frontend`` (and its subcommands ``demo``, ``register``, ``flags``)."""

import sys

from frontend.cli import main

sys.exit(main())
