"""How every pdserve process starts, runs and stops.

    load settings   flags, TOML, PDSERVE_* variables      bad: exit 2, one line on stderr
    prepare         logging, UCX variables, CPU pinning   bad: exit 2, one line on stderr
    serve           bind, load the model, then run        fails to start: exit 1, one line
                    until SIGINT/SIGTERM                  clean stop: exit 0
                    or until a vital loop fails           exit 1, traceback logged, one line
                    or on a ServiceExit                   its exit_code, one line

A service is a coroutine ``serve(settings, stop)``: it starts its parts, waits with
:func:`until_stopped` (which watches the loops it cannot live without), and closes its
parts in a ``finally``. A loop that dies must take the process down: a process that
still answers nothing would hang its peers silently, while a dead one is restarted by
its supervisor and seen by the conductor.

Some ends are not crashes, and restarting would only repeat them (a worker the conductor
refuses for its settings). Such an end raises a :class:`ServiceExit` subclass, from
``serve`` or from a vital loop; its ``exit_code`` (e.g. :data:`EXIT_CONFIG`) lets the
supervisor tell it from a crash: the shipped supervisord and systemd configs do not
restart on ``EXIT_CONFIG`` (docs/deploy.md). The one-line error also goes to
``/dev/termination-log`` where it exists, which Kubernetes shows as the container's
termination message.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import structlog
import zmq

from common import early_stop

log = structlog.get_logger(__name__)

S = TypeVar("S")

EXIT_OK = 0
EXIT_FAILED = 1  # could not start (address in use, missing model), or a vital loop died
EXIT_USAGE = 2  # bad settings or command line, as argparse does
# sysexits.h EX_CONFIG: the settings conflict with the cluster's; a restart with the same
# settings ends the same way, so supervisors are told not to restart on it.
EXIT_CONFIG = 78

# Kubernetes' default terminationMessagePath; written only where it exists.
TERMINATION_LOG = Path("/dev/termination-log")

# Failures whose message says it all (a bind, a file, a setting a service checks late);
# anything else is a bug and gets its traceback logged as well.
STARTUP_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, zmq.ZMQError)


class LoopFailed(RuntimeError):
    """A loop the service cannot live without ended with an error or was cancelled."""


class ServiceExit(RuntimeError):
    """An end of the service that is not a crash: the process exits with ``exit_code``
    and the message on one line, without a traceback. Subclasses set ``exit_code``."""

    exit_code: int = EXIT_FAILED


def install_uvloop() -> None:
    """Make uvloop the event loop policy if it is installed; otherwise do nothing."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def until_stopped(stop: asyncio.Event, loops: Iterable[asyncio.Task]) -> None:
    """Wait for ``stop``; raise LoopFailed as soon as one of ``loops`` fails or is
    cancelled. A loop that returns normally had a finite job (an announce) and is let go."""
    waiter = asyncio.ensure_future(stop.wait())
    pending: set[asyncio.Future] = {waiter, *loops}
    try:
        while not stop.is_set():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is waiter:
                    continue
                name = _loop_name(task)
                if task.cancelled():
                    raise LoopFailed(f"{name} was cancelled")
                if task.exception() is not None:
                    exc = task.exception()
                    raise LoopFailed(f"{name} failed: {exc!r}") from exc
    finally:
        waiter.cancel()


def run_service(name: str, load: Callable[[], S],
                serve: Callable[[S, asyncio.Event], Awaitable[None]], *,
                prepare: Callable[[S], None] | None = None,
                startup_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``serve(settings, stop)`` on uvloop until SIGINT/SIGTERM; the exit code.

    ``load`` reads the settings (argparse's own exit for --help or a usage error is
    passed through); ``prepare`` applies the process-wide ones (logging, environment)
    before the event loop exists; ``startup_errors`` adds the service's own expected
    failures to :data:`STARTUP_ERRORS`.
    """
    try:
        settings = load()
    except SystemExit as exc:  # argparse has printed the help or the usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except ValueError as exc:
        return _fail(name, str(exc), EXIT_USAGE)
    try:
        if prepare is not None:
            prepare(settings)
    except (ValueError, OSError) as exc:  # e.g. CPUs to pin to that this machine lacks
        return _fail(name, str(exc), EXIT_USAGE)
    install_uvloop()
    try:
        asyncio.run(_serve_until_signal(serve, settings))
    except ServiceExit as exc:
        return _fail(name, _describe(exc), exc.exit_code)
    except LoopFailed as exc:
        if isinstance(exc.__cause__, ServiceExit):  # raised by a vital loop
            return _fail(name, _describe(exc.__cause__), exc.__cause__.exit_code)
        log.error("service loop failed", service=name, exc_info=exc.__cause__ or exc)
        return _fail(name, str(exc), EXIT_FAILED)
    except (*STARTUP_ERRORS, *startup_errors) as exc:
        return _fail(name, f"could not start: {_describe(exc)}", EXIT_FAILED)
    except Exception as exc:
        log.exception("service failed", service=name)
        return _fail(name, _describe(exc), EXIT_FAILED)
    return EXIT_OK


async def _serve_until_signal(serve: Callable[[S, asyncio.Event], Awaitable[None]],
                              settings: S) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            loop.add_signal_handler(sig, stop.set)
    if early_stop.asked():  # a SIGTERM while the process was still importing
        stop.set()
    await serve(settings, stop)


def _fail(name: str, message: str, code: int) -> int:
    line = f"pdserve {name}: error: {message}"
    print(line, file=sys.stderr, flush=True)
    if TERMINATION_LOG.exists():
        try:
            TERMINATION_LOG.write_text(line + "\n")
        except OSError as exc:  # the message is on stderr already
            print(f"pdserve {name}: cannot write {TERMINATION_LOG}: {exc}", file=sys.stderr)
    return code


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line, whatever the exception wrote
    return text or type(exc).__name__


def _loop_name(task: asyncio.Task) -> str:
    return getattr(task.get_coro(), "__qualname__", None) or task.get_name()
