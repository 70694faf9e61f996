"""A stop asked for before a service's event loop exists.

A model worker spends its first seconds importing torch and loading weights, long
before ``run_service`` installs its signal handlers; a SIGTERM then (a planner or
supervisor stopping a worker it has just started) would kill it with the signal's
default action, an unclean exit. The worker entry points call :func:`catch` first, so
such a SIGTERM is only noted; ``run_service`` then stops the service as soon as its
loop runs, and it exits 0 like any other asked-for stop. Nothing here imports more
than ``signal``: it must run before the heavy imports.
"""

from __future__ import annotations

import signal

_asked = False


def _note(signum: int, frame: object) -> None:
    global _asked
    _asked = True


def catch() -> None:
    """Note SIGTERM from now on instead of dying of it."""
    signal.signal(signal.SIGTERM, _note)


def asked() -> bool:
    """Whether a SIGTERM arrived since :func:`catch`."""
    return _asked
