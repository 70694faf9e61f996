"""``common/address.py``: parsing, writing and wildcard replacement of scheme://host:port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.address import (
    WILDCARD_HOSTS,
    Address,
    dial_target,
    format_address,
    is_wildcard,
    parse_address,
    with_host,
)


def test_ipv4_and_names_round_trip():
    assert parse_address("tcp://10.0.0.7:5580") == Address("tcp", "10.0.0.7", 5580)
    assert parse_address("ucx://gpu-node-7:41002", "ucx") == Address("ucx", "gpu-node-7", 41002)
    assert format_address("shm", "127.0.0.1", 0) == "shm://127.0.0.1:0"
    assert str(parse_address("tcp://pool-host:65535")) == "tcp://pool-host:65535"


def test_ipv6_in_brackets():
    assert parse_address("tcp://[fd00::7]:5580") == Address("tcp", "fd00::7", 5580)
    assert parse_address("tcp://::1:7000") == Address("tcp", "::1", 7000)  # read, not written
    assert format_address("tcp", "fd00::7", 5580) == "tcp://[fd00::7]:5580"
    assert format_address("tcp", "[fd00::7]", 5580) == "tcp://[fd00::7]:5580"
    assert str(parse_address("tcp://::1:7000")) == "tcp://[::1]:7000"


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:1", "tcp://*:1", "tcp://[::]:1", "tcp://:1"])
def test_wildcard_forms(address):
    parsed = parse_address(address)
    assert parsed.is_wildcard and is_wildcard(parsed.host)
    assert with_host(address, "10.0.0.7") == "tcp://10.0.0.7:1"
    assert with_host(address, "fd00::7") == "tcp://[fd00::7]:1"
    assert with_host(address, "") == address  # a wildcard is no replacement
    assert set(WILDCARD_HOSTS) == {"0.0.0.0", "*", "::", "[::]", ""}


def test_with_host_leaves_a_real_host():
    assert with_host("ucx://10.1.1.1:9", "10.0.0.7") == "ucx://10.1.1.1:9"
    assert with_host("tcp://[fd00::1]:9", "10.0.0.7") == "tcp://[fd00::1]:9"


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.7:5580",  # no scheme
        "://h:1",
        "tcp://host",  # no port
        "tcp://host:",
        "tcp://host:x1",
        "tcp://host:65536",
        "tcp://host:²",  # a digit, not an ASCII one
        "tcp://[::1:7000",
        "tcp://[host]:7",  # brackets are for IPv6
        "ipc:///tmp/ev",
        "ipc:///tmp/a:5",
        "shm://pdserve-1/ctl",
        "tcp://user@host:1",
        None,
        7000,
    ],
)
def test_bad_input_is_a_value_error(address):
    with pytest.raises(ValueError, match="not an address"):
        parse_address(address)
    with pytest.raises(ValueError):
        with_host(address, "10.0.0.7")


def test_scheme_is_checked_and_dialing_needs_a_host():
    with pytest.raises(ValueError, match=r"not a tcp address \(tcp://host:port\)"):
        parse_address("ucx://h:1", "tcp")
    assert dial_target("tcp://[::1]:7", "tcp") == ("::1", 7)
    with pytest.raises(ValueError, match="not a shm address"):
        dial_target("shm://:7", "shm")


def test_imports_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import common.address;"
        "bad = {m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)"
        " - {'common'}; assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=root)
