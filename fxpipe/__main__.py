"""``python3 -m fxpipe ...`` is the same as the ``fxpipe`` console script."""

import sys

from fxpipe.cli import main

sys.exit(main())
