"""EncoderGraphConfig: defaults, validation and --hf-overrides parsing."""

from __future__ import annotations

import json

import pytest

from omnitrace import ConfigError, EncoderGraphConfig
from omnitrace.config import HF_OVERRIDE_KEYS

MAX = "encoder_cuda_graph_max_graphs"
CALLS = "encoder_cuda_graph_min_capture_calls"
FREE = "encoder_cuda_graph_min_free_bytes"
SHARE = "encoder_cuda_graph_share_pools"
EXPANDABLE = "encoder_cuda_graph_expandable_pools"
ON = "encoder_cuda_graph"
AUDIO = "encoder_cuda_graph_audio_attention"


def test_defaults_capture_on_the_second_call_under_a_pool_budget() -> None:
    """Defaults: at most 32 graphs under a 2 GiB pool budget, capture on the second call, a
    1 GiB floor, shared pools."""
    cfg = EncoderGraphConfig()
    assert (cfg.enabled, cfg.max_graphs, cfg.min_capture_calls) == (True, 32, 2)
    assert cfg.pool_budget_bytes == 2 * 1024**3
    assert cfg.by_default_budget
    assert cfg.min_free_bytes == 1073741824
    assert cfg.share_pools is True
    assert cfg.expandable_pools is True
    assert cfg.history_size == 128
    assert cfg.audio_attention == "native"


@pytest.mark.parametrize(
    "given",
    [
        {"max_graphs": 4},
        {MAX: 4},
    ],
)
def test_a_graph_count_set_alone_follows_the_design_note(given: dict[str, int]) -> None:
    """max_graphs set without a budget is a plain count: no budget, history of four per graph."""
    if MAX in given:
        cfg = EncoderGraphConfig.from_hf_overrides(given)
    else:
        cfg = EncoderGraphConfig(**given)
    assert (cfg.max_graphs, cfg.pool_budget_bytes, cfg.history_size) == (4, 0, 16)
    assert not cfg.by_default_budget


def test_a_budget_set_alone_keeps_the_default_ceiling_and_a_later_cap_drops_it() -> None:
    cfg = EncoderGraphConfig(pool_budget_bytes=512 << 20)
    assert (cfg.max_graphs, cfg.pool_budget_bytes) == (32, 512 << 20)
    # A cap set later on the defaults stands alone, as it would have from the start ...
    assert EncoderGraphConfig().replace(max_graphs=4).pool_budget_bytes == 0
    # ... but a budget the user chose is kept, and so is the default pair for other changes.
    assert cfg.replace(max_graphs=8).pool_budget_bytes == 512 << 20
    assert EncoderGraphConfig().replace(compile=True).pool_budget_bytes == 2 * 1024**3
    # The round trip through the overrides rebuilds the same config.
    for config in (cfg, EncoderGraphConfig(), EncoderGraphConfig(max_graphs=4)):
        assert EncoderGraphConfig.from_hf_overrides(config.to_hf_overrides()) == config


def test_from_hf_overrides_reads_every_key() -> None:
    """Every documented key sets its field."""
    cfg = EncoderGraphConfig.from_hf_overrides(
        {ON: True, MAX: 7, CALLS: 3, FREE: 0, SHARE: False, EXPANDABLE: False}
    )
    assert cfg == EncoderGraphConfig(
        enabled=True,
        max_graphs=7,
        min_capture_calls=3,
        min_free_bytes=0,
        share_pools=False,
        expandable_pools=False,
    )


def test_from_hf_overrides_accepts_json_text_and_ignores_model_keys() -> None:
    """A JSON string parses like the mapping, and non-encoder-graph keys are left to the model."""
    text = json.dumps({MAX: 2, "architectures": ["MiniCPMO"], "vision_config": {"x": 1}})
    assert EncoderGraphConfig.from_hf_overrides(text).max_graphs == 2


@pytest.mark.parametrize("route", ["native", "masked"])
def test_audio_attention_accepts_its_routes(route: str) -> None:
    """encoder_cuda_graph_audio_attention takes "native" or "masked" and round-trips."""
    cfg = EncoderGraphConfig.from_hf_overrides({AUDIO: route})
    assert cfg.audio_attention == route
    assert cfg.to_hf_overrides()[AUDIO] == route
    assert EncoderGraphConfig.from_hf_overrides(cfg.to_hf_overrides()) == cfg


@pytest.mark.parametrize("overrides", [None, {}, "", "   "])
def test_empty_overrides_give_defaults(overrides: object) -> None:
    """No overrides means the default config."""
    assert EncoderGraphConfig.from_hf_overrides(overrides) == EncoderGraphConfig()  # type: ignore[arg-type]


def test_enforce_eager_always_disables() -> None:
    """--enforce-eager wins over an explicit encoder_cuda_graph=true."""
    cfg = EncoderGraphConfig.from_hf_overrides({ON: True, MAX: 4}, enforce_eager=True)
    assert cfg.enabled is False
    assert cfg.captures_enabled is False


def test_zero_max_graphs_disables_capture() -> None:
    """max_graphs=0 is valid and means no capture (the adapter counts capacity misses)."""
    cfg = EncoderGraphConfig.from_hf_overrides({MAX: 0})
    assert cfg.captures_enabled is False


MAX_RANGE = "an integer from 0 to 1024 (0 keeps no graph)"
CALLS_RANGE = "an integer from 2 to 2**63-1"
FREE_RANGE = "a number of bytes from 0 to 2**63-1 (0 disables the check)"
ROUTES = "'native' or 'masked'"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (MAX, -1, f"{MAX}: expected {MAX_RANGE}, got -1 (int)"),
        (MAX, True, f"{MAX}: expected {MAX_RANGE}, got True (bool)"),
        (MAX, 4.0, f"{MAX}: expected {MAX_RANGE}, got 4.0 (float)"),
        (MAX, "4", f"{MAX}: expected {MAX_RANGE}, got '4' (str)"),
        (MAX, None, f"{MAX}: expected {MAX_RANGE}, got None (NoneType)"),
        (MAX, 1025, f"{MAX}: expected {MAX_RANGE}, got 1025 (int)"),
        (MAX, 2**63, f"{MAX}: expected {MAX_RANGE}, got 9223372036854775808 (int)"),
        pytest.param(
            MAX,
            10**5000,
            f"{MAX}: expected {MAX_RANGE}, got an integer of 16610 bits (int)",
            id="5000-digit-int",
        ),
        (MAX, [[[[[[[[1]]]]]]]], f"{MAX}: expected {MAX_RANGE}, got [[[[[[[...]]]]]]] (list)"),
        (
            MAX,
            "x" * 5000,
            f"{MAX}: expected {MAX_RANGE}, got '{'x' * 27}...{'x' * 28}' (str)",
        ),
        (CALLS, 1, f"{CALLS}: expected {CALLS_RANGE}, got 1 (int)"),
        (CALLS, 0, f"{CALLS}: expected {CALLS_RANGE}, got 0 (int)"),
        (CALLS, 2.5, f"{CALLS}: expected {CALLS_RANGE}, got 2.5 (float)"),
        (CALLS, False, f"{CALLS}: expected {CALLS_RANGE}, got False (bool)"),
        (CALLS, 2**63, f"{CALLS}: expected {CALLS_RANGE}, got 9223372036854775808 (int)"),
        (FREE, -5, f"{FREE}: expected {FREE_RANGE}, got -5 (int)"),
        (FREE, "1GiB", f"{FREE}: expected {FREE_RANGE}, got '1GiB' (str)"),
        (FREE, 1e9, f"{FREE}: expected {FREE_RANGE}, got 1000000000.0 (float)"),
        (FREE, 2**63, f"{FREE}: expected {FREE_RANGE}, got 9223372036854775808 (int)"),
        (SHARE, 1, f"{SHARE}: expected true or false, got 1 (int)"),
        (SHARE, "false", f"{SHARE}: expected true or false, got 'false' (str)"),
        (EXPANDABLE, "on", f"{EXPANDABLE}: expected true or false, got 'on' (str)"),
        (ON, 0, f"{ON}: expected true or false, got 0 (int)"),
        (ON, "yes", f"{ON}: expected true or false, got 'yes' (str)"),
        (AUDIO, "flash", f"{AUDIO}: expected {ROUTES}, got 'flash' (str)"),
        (AUDIO, "Masked", f"{AUDIO}: expected {ROUTES}, got 'Masked' (str)"),
        (AUDIO, True, f"{AUDIO}: expected {ROUTES}, got True (bool)"),
        (AUDIO, None, f"{AUDIO}: expected {ROUTES}, got None (NoneType)"),
        (AUDIO, ["masked"], f"{AUDIO}: expected {ROUTES}, got ['masked'] (list)"),
    ],
)
def test_bad_values_name_key_value_and_range(key: str, value: object, message: str) -> None:
    """Each bad value family raises ConfigError naming the key, the value and what is accepted."""
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig.from_hf_overrides({key: value})
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_unknown_key_suggests_the_closest() -> None:
    """A misspelt encoder_cuda_graph_* key is an error that suggests the valid key."""
    with pytest.raises(ConfigError, match=r"did you mean 'encoder_cuda_graph_max_graphs'\?"):
        EncoderGraphConfig.from_hf_overrides({"encoder_cuda_graph_max_graph": 3})


def test_unknown_key_far_from_any_lists_the_valid_ones() -> None:
    """An unknown key with no close match still lists what is valid."""
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig.from_hf_overrides({"encoder_cuda_graph_zzz": 3})
    assert "unknown encoder graph option" in str(info.value)
    assert "encoder_cuda_graph_share_pools" in str(info.value)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "4"])
def test_bad_json_or_non_object_is_a_config_error(text: str) -> None:
    """Invalid JSON or a JSON value that is not an object raises ConfigError."""
    with pytest.raises(ConfigError, match="hf_overrides: expected a JSON object"):
        EncoderGraphConfig.from_hf_overrides(text)


def test_enforce_eager_must_be_bool() -> None:
    """enforce_eager is validated like every other switch."""
    with pytest.raises(ConfigError, match="enforce_eager: expected true or false, got 1"):
        EncoderGraphConfig.from_hf_overrides({}, enforce_eager=1)  # type: ignore[arg-type]


def test_direct_construction_validates_too() -> None:
    """Building the dataclass directly applies the same rules."""
    with pytest.raises(ConfigError, match=MAX):
        EncoderGraphConfig(max_graphs=-2)


def test_config_is_frozen_and_replace_validates() -> None:
    """The config cannot be mutated; replace() returns a validated copy."""
    cfg = EncoderGraphConfig()
    with pytest.raises(AttributeError):
        cfg.max_graphs = 3  # type: ignore[misc]
    assert cfg.replace(max_graphs=8).max_graphs == 8
    with pytest.raises(ConfigError, match=CALLS):
        cfg.replace(min_capture_calls=1)
    with pytest.raises(ConfigError, match="not an EncoderGraphConfig field"):
        cfg.replace(max_graph=1)


def test_to_hf_overrides_round_trips() -> None:
    """to_hf_overrides() produces overrides that rebuild the same config."""
    cfg = EncoderGraphConfig(max_graphs=3, min_capture_calls=5, min_free_bytes=7, share_pools=False)
    assert EncoderGraphConfig.from_hf_overrides(cfg.to_hf_overrides()) == cfg


def test_largest_values_that_fit_are_accepted() -> None:
    """The bounds themselves are valid: 1024 graphs, int64 calls and bytes."""
    cfg = EncoderGraphConfig(max_graphs=1024, min_capture_calls=2**63 - 1, min_free_bytes=2**63 - 1)
    assert cfg.history_size == 4096


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"architectures": ["MiniCPMO"], "seed": ' + "7" * 5000 + "}",
            None,
        ),
        (
            '{"' + MAX + '": ' + "7" * 5000 + "}",
            f"{MAX}: expected {MAX_RANGE}, got a 5000-digit integer",
        ),
        (
            '{"' + FREE + '": -' + "7" * 5000 + "}",
            f"{FREE}: expected {FREE_RANGE}, got a 5000-digit integer",
        ),
        (
            "[" * 100_000,
            "hf_overrides: expected a JSON object, got JSON nested too deeply to parse",
        ),
        (
            '{"vision_config": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "hf_overrides: expected a JSON object, got JSON nested too deeply to parse",
        ),
    ],
    ids=["long-int-ignored-key", "long-int-max-graphs", "long-negative-int", "deep", "deep-value"],
)
def test_json_that_python_cannot_convert_is_a_one_line_config_error(
    text: str, message: str | None
) -> None:
    """A 5,000-digit integer or 100,000 nested arrays never escape as ValueError or
    RecursionError: an ignored key is ignored, a key of ours names itself, nesting names
    hf_overrides."""
    if message is None:
        assert EncoderGraphConfig.from_hf_overrides(text) == EncoderGraphConfig()
        return
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig.from_hf_overrides(text)
    assert str(info.value) == message


def test_a_huge_unknown_key_is_shortened_in_the_error() -> None:
    """An unknown key of 100,000 characters gives a short one-line error."""
    key = "encoder_cuda_graph_" + "z" * 100_000
    with pytest.raises(ConfigError) as info:
        EncoderGraphConfig.from_hf_overrides({key: 1})
    text = str(info.value)
    assert "\n" not in text
    # The key is cut to a few dozen characters; the list of valid keys grows with each key.
    assert len(text) < 120 + len(", ".join(HF_OVERRIDE_KEYS))
    assert text.startswith("'encoder_cuda_graph_zzz")
    assert "unknown encoder graph option" in text
