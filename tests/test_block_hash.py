"""Chained block hashes: determinism, chaining, and a pinned wire format."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from common.block_hash import BLOCK_HASH_SEED, ROOT_PARENT_HASH, hash_block, hash_blocks

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENS = list(range(100, 112))  # three blocks of 4
FP = "llama-test"


def test_deterministic_and_unsigned_64_bit():
    first = hash_blocks(TOKENS, 4, FP)
    assert first == hash_blocks(list(TOKENS), 4, FP)
    assert first == hash_blocks(tuple(TOKENS), 4, FP)
    assert len(set(first)) == 3
    assert all(0 <= h < 1 << 64 for h in first)


def test_chain_matches_hash_block_step_by_step():
    h0 = hash_block(ROOT_PARENT_HASH, TOKENS[0:4], FP)
    h1 = hash_block(h0, TOKENS[4:8], FP)
    h2 = hash_block(h1, TOKENS[8:12], FP)
    assert hash_blocks(TOKENS, 4, FP) == [h0, h1, h2]
    # Extending a chain from a known parent gives the same tail.
    assert hash_blocks(TOKENS[4:], 4, FP, parent_hash=h0) == [h1, h2]


def test_changing_block_0_changes_every_later_hash():
    base = hash_blocks(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[1] += 1
    other = hash_blocks(changed, 4, FP)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_changing_block_1_keeps_hash_0():
    base = hash_blocks(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[5] += 1
    other = hash_blocks(changed, 4, FP)
    assert other[0] == base[0]
    assert other[1] != base[1]
    assert other[2] != base[2]


def test_fingerprint_and_salt_change_hashes():
    base = hash_blocks(TOKENS, 4, FP)
    assert hash_blocks(TOKENS, 4, FP + "-bf16")[0] != base[0]
    salted = hash_blocks(TOKENS, 4, FP, cache_salt="tenant-a")
    assert salted[0] != base[0]
    assert hash_blocks(TOKENS, 4, FP, cache_salt="tenant-b")[0] != salted[0]


def test_salt_none_differs_from_empty_salt():
    assert hash_block(ROOT_PARENT_HASH, [1, 2], FP, None) != hash_block(
        ROOT_PARENT_HASH, [1, 2], FP, ""
    )


def test_field_boundaries_are_unambiguous():
    # Moving bytes between fingerprint and salt must not collide.
    assert hash_block(ROOT_PARENT_HASH, [1], "ab", "c") != hash_block(
        ROOT_PARENT_HASH, [1], "a", "bc"
    )
    # A token count prefix separates [] + fingerprint from tokens that spell it.
    assert hash_block(ROOT_PARENT_HASH, [], "x") != hash_block(ROOT_PARENT_HASH, [0], "x")


def test_only_full_blocks_are_hashed():
    assert hash_blocks(TOKENS[:3], 4, FP) == []
    assert hash_blocks(TOKENS[:7], 4, FP) == hash_blocks(TOKENS[:4], 4, FP)
    assert len(hash_blocks(TOKENS[:11], 4, FP)) == 2
    assert hash_blocks([], 4, FP) == []


def test_invalid_inputs_raise_value_error():
    with pytest.raises(ValueError):
        hash_blocks(TOKENS, 0, FP)
    with pytest.raises(ValueError):
        hash_blocks(TOKENS, -4, FP)
    with pytest.raises(ValueError):
        hash_block(ROOT_PARENT_HASH, [-1], FP)
    with pytest.raises(ValueError):
        hash_block(ROOT_PARENT_HASH, [1 << 32], FP)
    with pytest.raises(ValueError):
        hash_block(1 << 64, [1], FP)


def test_known_answer_pins_the_wire_format():
    assert BLOCK_HASH_SEED == 0x7064736572766531
    assert ROOT_PARENT_HASH == 0x6B762D726F6F7430
    assert hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], "fp") == 17470514395616001697
    assert hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], "fp", "salt") == 12475748552932487064
    assert hash_blocks(list(range(10)), 4, FP) == [17211399487213729086, 11437645306486624161]


def test_byte_layout_is_explicit_little_endian():
    parent = 0x0102030405060708
    data = (
        struct.pack("<Q", parent)
        + struct.pack("<I3I", 3, 7, 70000, 1 << 31)
        + struct.pack("<I", 2)
        + b"fp"
        + b"\x01"
        + struct.pack("<I", 2)
        + "é".encode()  # 2 bytes in UTF-8: the prefix counts bytes, not characters
    )
    expected = xxhash.xxh3_64_intdigest(data, seed=BLOCK_HASH_SEED)
    assert hash_block(parent, [7, 70000, 1 << 31], "fp", "é") == expected


_CHILD = (
    "import json, sys\n"
    "from common.block_hash import hash_blocks\n"
    "print(json.dumps([hash_blocks(list(range(100, 112)), 4, 'llama-test', s)"
    " for s in (None, '', 'tenant-a')]))\n"
)


@pytest.mark.parametrize("seed", ["0", "1", "random"])
def test_same_hashes_under_any_pythonhashseed(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    expected = [hash_blocks(TOKENS, 4, FP, s) for s in (None, "", "tenant-a")]
    assert json.loads(out.stdout) == expected


def test_importable_without_torch():
    code = (
        "import sys\n"
        "import common.block_hash\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "[]"
