"""``python3 -m fxpipe ...`` is the same as the ``fxpipe`` console script."""

from fxpipe.cli import console

console()
