"""One parser for sizes and counts, one check per kind of misuse, one Backend contract."""

from __future__ import annotations

import pytest

from rlmem._checks import check_choice, check_flag, check_int
from rlmem._units import GiB, MiB, format_bytes, parse_bytes, parse_count
from rlmem.memory import Backend
from rlmem.memory._host import HostBackend


def test_parse_bytes_accepts_the_documented_forms() -> None:
    assert parse_bytes("80GiB", "x") == 80 * GiB
    assert parse_bytes("80G", "x") == 80 * GiB  # a bare letter is binary
    assert parse_bytes("85GB", "x") == 85 * 10**9
    assert parse_bytes("512MiB", "x") == 512 * MiB
    assert parse_bytes("1.5GiB", "x") == int(1.5 * GiB)
    assert parse_bytes("4096B", "x") == 4096
    assert parse_bytes(" 64 mib ", "x") == 64 * MiB
    assert parse_bytes(4096, "x_bytes", bare=True) == 4096
    assert parse_bytes("0GiB", "x", zero=True) == 0


@pytest.mark.parametrize("value", ["80", 80, "1.5e9", 1.5])
def test_parse_bytes_refuses_a_bare_number(value: object) -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory: .* has no unit; write a size such as 80GiB"):
        parse_bytes(value, "--gpu-memory")


@pytest.mark.parametrize("value", ["lots", "80XB", "-1GiB", "0GiB", None, True, ""])
def test_parse_bytes_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="kv_budget"):
        parse_bytes(value, "kv_budget")


def test_parse_count() -> None:
    assert parse_count("8192", "n") == 8192
    assert parse_count("8k", "n") == 8000
    assert parse_count("8K", "n") == 8192
    assert parse_count("1.5e9", "n") == 1_500_000_000
    assert parse_count("2M", "n") == 2 << 20
    assert parse_count(12, "n") == 12
    assert parse_count("0", "n", zero=True) == 0
    for bad in ("8GiB", "1.5", "k", "-3", "0", True):
        with pytest.raises(ValueError, match="--micro-batch-tokens"):
            parse_count(bad, "--micro-batch-tokens")


def test_format_bytes() -> None:
    assert format_bytes(18.4 * GiB) == "18.400 GiB"
    assert format_bytes(GiB, 1) == "1.0 GiB"


def test_checks_raise_value_error_naming_the_field() -> None:
    assert check_flag("blocking", True) is True
    with pytest.raises(ValueError, match="blocking must be True or False, got 'yes'"):
        check_flag("blocking", "yes")
    assert check_int("steps", 3) == 3
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            check_int("steps", bad)
    assert check_choice("comms", "keep", ("keep", "suspend")) == "keep"
    with pytest.raises(ValueError, match="comms must be one of 'keep', 'suspend'; got 'drop'"):
        check_choice("comms", "drop", ("keep", "suspend"))


def test_both_backends_satisfy_the_backend_protocol() -> None:
    host = HostBackend()
    host.open(1 << 16)
    assert isinstance(host, Backend)
    host.destroy()
    cuda = pytest.importorskip("rlmem.memory._cuda")
    missing = [
        name
        for name in Backend.__dict__
        if not name.startswith("_")
        and name not in ("kind", "asynchronous", "pinned_backup", "granularity", "device")
        and not hasattr(cuda.CudaBackend, name)
    ]
    assert missing == []


def test_plan_cli_takes_counts_and_refuses_bare_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    from rlmem.cli import main

    assert main(["plan", "qwen2-2.5b", "--micro-batch-tokens", "8k", "--gpu-memory", "80GiB"]) == 0
    assert "micro-batch 8000 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "qwen2-2.5b", "--micro-batch-tokens", "8192", "--gpu-memory", "80"])
    assert "--gpu-memory: '80' has no unit" in capsys.readouterr().err
