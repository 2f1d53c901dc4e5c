"""``python -m indexer``: the standalone KV indexer service."""

import sys

from indexer.app import main

sys.exit(main())
