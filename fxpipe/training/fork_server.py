"""Imported last by the fork server that ``fxpipe run`` forks its workers from (see
:data:`fxpipe.training.worker.PRELOAD`): freezes every object the server imported out of the
garbage collector, as Python's documentation advises before ``fork()`` without ``exec()``.

The workers' collections then never walk (nor copy-on-write) the server's torch and fxpipe
objects, and the server's own exit, when ``fxpipe run`` ends, skips the interpreter's final
collections over them (most of a second of CPU).
"""

import gc

gc.freeze()
