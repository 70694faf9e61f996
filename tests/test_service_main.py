"""How every service starts and stops: exit codes, one-line errors, signals, dead loops.

The processes here load no model (bad settings stop them before, the gateway gets a
tokenizer directory and a context length), so each one is up or down within seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from common import service_main
from common.service_main import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    LoopFailed,
    ServiceExit,
    until_stopped,
)
from tests.cluster import ROOT, free_port, stats

pytestmark = pytest.mark.timeout(60)

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def addr() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args, "--log-format",
                             "console"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 20.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"process did not exit:\n{err[-2000:]}")
    return proc.returncode, err


def error_lines(stderr: str, service: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"pdserve {service}: error:")]


BAD_SETTINGS = [
    ("gateway", ["--http-port", "eighty"], "http_port"),
    ("conductor", ["--heartbeat-interval-s", "soon"], "heartbeat_interval_s"),
    ("cache-pool", ["--dram-mib", "-1"], "dram_mib"),
    ("prefill", ["--kv-lease-s", "0"], "kv_lease_s"),
    ("decode", ["--transfer-backend", "pigeon"], "transfer_backend"),
    ("unified", ["--cpu-affinity", "3-1"], "3-1"),
]


@pytest.mark.parametrize(("service", "args", "named"), BAD_SETTINGS,
                         ids=[s for s, _, _ in BAD_SETTINGS])
def test_a_bad_setting_exits_2_with_one_line(service, args, named):
    code, err = finish(start(service, *args))
    assert code == EXIT_USAGE, err
    lines = error_lines(err, service)
    assert len(lines) == 1 and named in lines[0], err
    assert "Traceback" not in err


def test_an_unknown_flag_is_a_usage_error():
    code, err = finish(start("conductor", "--no-such-setting", "1"))
    assert code == EXIT_USAGE
    assert "unrecognized arguments: --no-such-setting" in err


def test_conductor_address_in_use_exits_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = finish(start("conductor", "--control-addr", f"tcp://127.0.0.1:{port}",
                                 "--heartbeat-addr", addr()))
    assert code == EXIT_FAILED, err
    [line] = error_lines(err, "conductor")
    assert "could not start" in line and "Address already in use" in line, err
    assert "Traceback" not in err


def _tokenizer_dir(path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(
        str(path / "tokenizer.json"))
    return str(path)


def _gateway(tmp_path, http_port: int) -> subprocess.Popen:
    return start("gateway", "--tokenizer-dir", _tokenizer_dir(tmp_path), "--max-model-len",
                 "64", "--http-port", str(http_port), "--zmq-addr", addr(),
                 "--stream-bind", addr(), "--conductor-addr", addr())


def test_gateway_http_port_in_use_exits_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = finish(_gateway(tmp_path, port))
    assert code == EXIT_FAILED, err
    [line] = error_lines(err, "gateway")
    assert f"http://127.0.0.1:{port}" in line and "in use" in line, err


def _wait_http(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gateway exited:\n{proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail("gateway did not listen")


def test_conductor_stops_cleanly_on_sigterm():
    control = addr()
    proc = start("conductor", "--control-addr", control, "--heartbeat-addr", addr())
    deadline = time.monotonic() + 20
    while True:
        try:
            stats(control, 0.3)
            break
        except TimeoutError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == EXIT_OK, err
    assert "error" not in err.lower()


def test_gateway_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    proc = _gateway(tmp_path, port)
    _wait_http(port, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == EXIT_OK, err
    assert "Traceback" not in err


# ---- in process: the loop watch and the exit codes -------------------------------------


async def _forever() -> None:
    await asyncio.Event().wait()


async def _broken() -> None:
    await asyncio.sleep(0.01)
    raise KeyError("lost its socket")


async def _finite() -> None:
    await asyncio.sleep(0)


async def test_until_stopped_returns_on_stop_and_lets_finite_loops_end():
    stop = asyncio.Event()
    loops = [asyncio.create_task(_forever()), asyncio.create_task(_finite())]
    asyncio.get_running_loop().call_later(0.05, stop.set)
    await asyncio.wait_for(until_stopped(stop, loops), 2)
    assert loops[1].done() and not loops[0].done()
    loops[0].cancel()


async def test_until_stopped_raises_when_a_loop_dies():
    loops = [asyncio.create_task(_forever()), asyncio.create_task(_broken())]
    with pytest.raises(LoopFailed, match="_broken failed: KeyError") as info:
        await asyncio.wait_for(until_stopped(asyncio.Event(), loops), 2)
    assert isinstance(info.value.__cause__, KeyError)
    loops[0].cancel()


async def test_until_stopped_raises_when_a_loop_is_cancelled():
    loop = asyncio.create_task(_forever())
    asyncio.get_running_loop().call_later(0.01, loop.cancel)
    with pytest.raises(LoopFailed, match="_forever was cancelled"):
        await asyncio.wait_for(until_stopped(asyncio.Event(), [loop]), 2)


@pytest.fixture
def no_uvloop(monkeypatch):
    """run_service would otherwise leave uvloop's policy behind for the other tests."""
    monkeypatch.setattr(service_main, "install_uvloop", lambda: None)


def test_a_dead_loop_takes_the_service_down(no_uvloop, capsys):
    closed = []

    async def serve(settings, stop):
        task = asyncio.create_task(_broken())
        try:
            await until_stopped(stop, [task])
        finally:
            closed.append(settings)

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_FAILED
    assert closed == ["s"]
    err = capsys.readouterr().err
    assert "pdserve demo: error: " in err and "_broken failed" in err


def test_an_unexpected_startup_error_exits_1(no_uvloop, capsys):
    async def serve(settings, stop):
        raise RuntimeError("half\nstarted")

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_FAILED
    assert error_lines(capsys.readouterr().err, "demo") == ["pdserve demo: error: half started"]


def test_stop_gives_exit_0_and_help_passes_through(no_uvloop):
    async def serve(settings, stop):
        stop.set()
        await until_stopped(stop, [])

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_OK

    def asks_for_help():
        raise SystemExit(0)
    assert service_main.run_service("demo", asks_for_help, serve) == EXIT_OK


class _Refused(ServiceExit):
    exit_code = EXIT_CONFIG


def test_a_service_exit_from_a_vital_loop_gives_its_code_and_one_line(no_uvloop, capsys,
                                                                     monkeypatch, tmp_path):
    """A refusal ends the process with its own code and message, no traceback, and the
    line is the container's termination message where Kubernetes provides the file."""
    term = tmp_path / "termination-log"
    term.touch()
    monkeypatch.setattr(service_main, "TERMINATION_LOG", term)

    async def refused():
        raise _Refused("refused by the conductor:\nblock_size 32 differs")

    async def serve(settings, stop):
        await until_stopped(stop, [asyncio.create_task(refused())])

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_CONFIG == 78
    err = capsys.readouterr().err
    line = "pdserve demo: error: refused by the conductor: block_size 32 differs"
    assert error_lines(err, "demo") == [line]
    assert "Traceback" not in err
    assert term.read_text() == line + "\n"


def test_a_service_exit_while_starting_gives_its_code(no_uvloop, capsys, monkeypatch,
                                                     tmp_path):
    monkeypatch.setattr(service_main, "TERMINATION_LOG", tmp_path / "absent")

    async def serve(settings, stop):
        raise _Refused("wrong settings")

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_CONFIG
    assert error_lines(capsys.readouterr().err, "demo") == ["pdserve demo: error: wrong settings"]
    assert not (tmp_path / "absent").exists()  # written only where the file exists


def test_a_crash_is_still_exit_1_and_reaches_the_termination_log(no_uvloop, capsys,
                                                                monkeypatch, tmp_path):
    term = tmp_path / "termination-log"
    term.touch()
    monkeypatch.setattr(service_main, "TERMINATION_LOG", term)

    async def serve(settings, stop):
        await until_stopped(stop, [asyncio.create_task(_broken())])

    assert service_main.run_service("demo", lambda: "s", serve) == EXIT_FAILED
    assert "_broken failed" in term.read_text()
