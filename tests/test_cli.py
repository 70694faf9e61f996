"""The ``pdserve`` command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_bad_sampling_value_is_a_clear_error():
    proc = run("generate", "--max-tokens", "0", "hello")
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    proc = run("generate", "--model", str(tmp_path / "absent.gguf"), "hello")
    assert proc.returncode == 2
    assert "absent.gguf" in proc.stderr


@pytest.mark.parametrize("flag, value, named", [
    ("--kv-cache-dtype", "float16", "kv_cache_dtype"),
    ("--quantization", "int3", "quantization"),
])
def test_bad_engine_setting_is_a_clear_error(flag, value, named):
    proc = run("generate", flag, value, "hello")
    assert proc.returncode == 2
    assert named in proc.stderr and value in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_chat_generation_on_default_model():
    proc = run("generate", "--chat", "--max-tokens", "24", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
