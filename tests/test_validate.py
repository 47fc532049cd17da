"""One validator per rule: ConfigError naming the setting, what was expected and what came."""

from __future__ import annotations

import pytest

from omnitrace import ConfigError, EncoderGraphConfig
from omnitrace._validate import INT64_MAX, check_bool, check_duration, check_int, check_number
from omnitrace._worker import env_rank, worker_rank
from omnitrace.graphs.backends.torch import TorchGraphBackend
from omnitrace.testing import SimulatedGraphBackend


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (-1, {}, r"^n: expected a nonnegative integer, got -1 \(int\)$"),
        (True, {}, r"^n: expected a nonnegative integer, got True \(bool\)$"),
        (4.0, {}, r"^n: expected a nonnegative integer, got 4.0 \(float\)$"),
        ("4", {}, r"^n: expected a nonnegative integer, got '4' \(str\)$"),
        (0, {"minimum": 1}, r"^n: expected a positive integer, got 0 \(int\)$"),
        (9, {"minimum": 2, "maximum": 8}, r"^n: expected an integer from 2 to 8, got 9 \(int\)$"),
        (INT64_MAX + 1, {}, r"^n: expected a nonnegative integer, got 9223372036854775808"),
        (10**200, {}, r"^n: expected a nonnegative integer, got an integer of 665 bits \(int\)$"),
    ],
)
def test_check_int_refuses_with_one_line_naming_the_setting(
    value: object, kwargs: dict[str, int], message: str
) -> None:
    """Wrong type, range, bool or a huge integer: ConfigError, one line, value shortened."""
    with pytest.raises(ConfigError, match=message):
        check_int("n", value, **kwargs)


def test_check_number_and_bool() -> None:
    """Numbers must be finite and positive; booleans must be booleans."""
    assert check_number("t", 2) == 2.0
    for bad in (0, -1.5, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigError, match=r"^t: expected a positive number of seconds"):
            check_number("t", bad, unit="seconds")
    assert check_number("t", 0, within=(0, 5)) == 0.0
    for bad in (-0.1, 5.5, float("nan"), float("inf")):
        with pytest.raises(
            ConfigError, match=r"^t: expected a number of seconds from 0 to 5, got "
        ):
            check_number("t", bad, unit="seconds", within=(0, 5))
    assert check_bool("b", False) is False
    with pytest.raises(ConfigError, match=r"^b: expected true or false, got 1 \(int\)$"):
        check_bool("b", 1)


def test_backends_use_the_validator_and_raise_config_errors() -> None:
    """Backend arguments are checked by the same validator (ConfigError, not ValueError)."""
    with pytest.raises(ConfigError, match=r"^warmup_iters: expected a nonnegative integer"):
        TorchGraphBackend(warmup_iters=-1)
    with pytest.raises(ConfigError, match=r"^graph_bytes: expected a nonnegative integer"):
        SimulatedGraphBackend(graph_bytes=True)  # type: ignore[arg-type]


def test_the_worker_rank_is_read_one_way() -> None:
    """RANK, then LOCAL_RANK, else 0; a set variable that is no rank is a ConfigError."""
    assert worker_rank({"RANK": "3", "LOCAL_RANK": "1"}) == 3
    assert worker_rank({"LOCAL_RANK": " 1 "}) == 1
    assert worker_rank({}) == 0
    assert env_rank("RANK", {"RANK": ""}) is None
    for bad in ("x", "-1", "1.0", "٣"):
        with pytest.raises(ConfigError, match=r"^RANK: expected a nonnegative integer"):
            env_rank("RANK", {"RANK": bad})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e-300, "1e-300 (float)"),
        (1e300, "1e+300 (float)"),
        (float("nan"), "nan (float)"),
        (-1, "-1 (int)"),
        (True, "True (bool)"),
        (10**400, "an integer of 1329 bits (int)"),
    ],
)
def test_check_duration_refuses_degenerate_values_naming_the_range(
    value: object, message: str
) -> None:
    """A duration outside its range, NaN, a bool or a huge int is a one-line ConfigError."""
    with pytest.raises(ConfigError) as info:
        check_duration("t", value, low=0.1, high=86_400, zero="off")
    assert str(info.value) == (
        f"t: expected 0 (off) or a number of seconds from 0.1 to 86400, got {message}"
    )
    assert check_duration("t", 0, low=0.1, high=86_400, zero="off") == 0.0
    assert check_duration("t", 86_400, low=0.1, high=86_400) == 86_400.0


def test_a_config_error_is_always_one_line() -> None:
    """Whatever a message quotes, a ConfigError's text is one line: controls are escaped."""
    error = ConfigError("bad key\nsecond line\r\x1b[31m\x07")
    assert str(error) == "bad key\\nsecond line\\r\\x1b[31m\\x07"


def test_an_unknown_key_with_a_new_line_is_a_one_line_error() -> None:
    """A key containing a new line is quoted escaped, so the error stays on one line."""
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig.from_hf_overrides('{"encoder_cuda_graph_max\\ngraphs": 1}')
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("encoder_cuda_graph_max\\ngraphs: unknown encoder graph option")
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig().replace(**{"max\ngraphs": 1})
    assert str(info.value).startswith("max\\ngraphs: not an EncoderGraphConfig field")
