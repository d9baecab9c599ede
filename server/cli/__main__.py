"""`python -m celeris.server.cli ...`: the `celeris` command's server side (server/cli/entry.py)."""

import sys

from celeris.server.cli.entry import main

sys.exit(main())
