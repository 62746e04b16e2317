"""`python -m relay.cli ...`, as the `relay` script."""

import sys

from relay.cli.main import main

sys.exit(main())
