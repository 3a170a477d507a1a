"""Imported by CPython's fork server when ``fxpipe run`` cannot fork its own
(:mod:`fxpipe.training.fork_server`): the workers' modules, loaded once in the server."""

from fxpipe.training.fork_server import serve_imports

serve_imports()
