"""What the fork server of ``fxpipe run`` imports (its only preload module, see
:func:`fxpipe.training.launch.start_fork_server`): torchrun's launcher forks every worker from
that server, so the workers start with torch, dynamo and fxpipe loaded instead of importing them
once each.

The server ignores Ctrl-C while it imports (the launcher stops it; a terminal's SIGINT would
print the middle of an import). When the imports are done every object is frozen out of the
garbage collector, as Python's documentation advises before ``fork()`` without ``exec()``: the
workers' collections never walk (nor copy-on-write) the server's objects, and the server's own
exit skips the interpreter's final collections over them (most of a second of CPU).
"""

import gc
import importlib
import signal

#: imported once by the server, in this order
MODULES = ("torch", "torch.distributed", "torch.export", "torch._dynamo",
           "torch.distributed.checkpoint", "fxpipe.training.compiled",
           "fxpipe.training.checkpoint", "fxpipe.runtime.executor", "fxpipe.data.batches",
           "fxpipe.training.worker")

signal.signal(signal.SIGINT, signal.SIG_IGN)
for _name in MODULES:
    importlib.import_module(_name)
gc.freeze()
