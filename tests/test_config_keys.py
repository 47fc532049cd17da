"""Misspelt --hf-overrides keys: one line naming the right key, wherever the config is read.

A key surely meant for omnitrace (its prefix in another spelling, vLLM's ``encoder_cudagraph_*``
among them, or a near miss of a whole key) is a ``ConfigError``; a bare option name or a
looser match, which may be the model's own key, is one warning and is left to the model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnitrace import ConfigError, EncoderGraphConfig
from omnitrace.cli import main
from omnitrace.config import HF_OVERRIDE_KEYS, misspelt_key
from omnitrace.integrations.base import config_from_model

MAX = "encoder_cuda_graph_max_graphs"
DEFAULT = EncoderGraphConfig()
VALID = ", ".join(sorted(HF_OVERRIDE_KEYS))
SPELT = "omnitrace's keys are spelt encoder_cuda_graph_*"


def _refused(key: str) -> str:
    with pytest.raises(ConfigError) as caught:
        EncoderGraphConfig.from_hf_overrides({key: 2})
    return str(caught.value)


def _warned(overrides: dict[str, object]) -> tuple[EncoderGraphConfig, list[str]]:
    said: list[str] = []
    config = EncoderGraphConfig.from_hf_overrides(overrides, warn=said.append)
    return config, said


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "encoder_cudagraph_max_graphs",
            f"encoder_cudagraph_max_graphs: unknown encoder graph option ({SPELT}); did you "
            f"mean '{MAX}'?",
        ),
        (
            "Encoder-CUDA-Graph-Max-Graphs",
            f"Encoder-CUDA-Graph-Max-Graphs: unknown encoder graph option ({SPELT}); did you "
            f"mean '{MAX}'?",
        ),
        (
            "encoder_cudagraph_min_capture_call",
            f"encoder_cudagraph_min_capture_call: unknown encoder graph option ({SPELT}); did "
            "you mean 'encoder_cuda_graph_min_capture_calls'?",
        ),
        (
            "encoder_cudagraph",
            f"encoder_cudagraph: unknown encoder graph option ({SPELT}); did you mean "
            "'encoder_cuda_graph'?",
        ),
        (
            "encoder_cuda_grph_max_graphs",
            f"encoder_cuda_grph_max_graphs: unknown encoder graph option; did you mean '{MAX}'?",
        ),
        (
            "encodr_cuda_graph_share_pools",
            "encodr_cuda_graph_share_pools: unknown encoder graph option; did you mean "
            "'encoder_cuda_graph_share_pools'?",
        ),
    ],
    ids=["vllm-spelling", "case-and-dashes", "vllm-spelling-typo", "switch", "grph", "encodr"],
)
def test_a_key_meant_for_omnitrace_is_refused_naming_the_right_key(key: str, message: str) -> None:
    """The prefix spelt another way, or a near miss of a whole key, is one line that names
    the key given and the key meant."""
    assert _refused(key) == message


def test_vllms_own_encoder_graph_settings_are_sent_to_the_compilation_config() -> None:
    """A field of vLLM's compilation config given in --hf-overrides (where it does nothing)
    says where it goes and which keys are omnitrace's."""
    assert _refused("encoder_cudagraph_token_budgets") == (
        "encoder_cudagraph_token_budgets: unknown encoder graph option (this is vLLM's own "
        f"encoder graph setting, which goes in --compilation-config; {SPELT}; valid: {VALID})"
    )


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("max_graphs", MAX),
        ("maxGraphs", MAX),
        ("max_graph", MAX),
        ("min_capture_calls", "encoder_cuda_graph_min_capture_calls"),
        ("compile", "encoder_cuda_graph_compile"),
        ("skip_profile", "encoder_cuda_graph_skip_profiling"),
        ("enable_cuda_graph", "encoder_cuda_graph"),
    ],
)
def test_a_bare_option_name_warns_once_and_is_left_to_the_model(key: str, meant: str) -> None:
    """A name that may be the model's own key runs with omnitrace's defaults and one warning
    naming the right key."""
    config, said = _warned({key: 2, "architectures": ["MiniCPMO"]})
    assert config == DEFAULT
    assert said == [
        f"{key}: not an encoder graph option, so omnitrace leaves it to the model; did you "
        f"mean '{meant}'?"
    ]


@pytest.mark.parametrize(
    "key",
    [
        "architectures",
        "hidden_size",
        "encoder_layers",
        "encoder_attention_heads",
        "encoder_ffn_dim",
        "encoder_config",
        "audio_config",
        "vision_config",
        "max_position_embeddings",
        "max_source_positions",
        "num_hidden_layers",
        "torch_dtype",
        "use_cache",
        "cuda_graph",
        "rope_scaling",
        "x" * 5000,
    ],
)
def test_model_keys_unlike_omnitraces_pass_without_a_word(key: str) -> None:
    """The keys of the supported models' configs are neither refused nor warned about."""
    config, said = _warned({key: 1})
    assert (config, said) == (DEFAULT, [])


@pytest.mark.parametrize("key", sorted(set(HF_OVERRIDE_KEYS) - {"encoder_cuda_graph"}))
def test_every_documented_key_misspelt_gets_its_suggestion(key: str) -> None:
    """The README's promise, for every key: vLLM's prefix, a letter dropped from the prefix
    or from the option, and the bare option name each name that key."""
    option = key.removeprefix("encoder_cuda_graph_")
    dropped = option[:-2] + option[-1]
    for refused in (
        f"encoder_cudagraph_{option}",
        f"encoder_cuda_grph_{option}",
        f"encoder_cuda_graph_{dropped}",
    ):
        assert _refused(refused).endswith(f"; did you mean '{key}'?"), refused
    _, said = _warned({option: 1})
    assert len(said) == 1
    assert said[0].endswith(f"; did you mean '{key}'?")


def test_a_warning_goes_to_the_config_logger_when_no_one_takes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without ``warn`` the line is logged at WARNING on omnitrace's logger, where the vLLM
    plugin shows it beside vLLM's lines; a control character in the key stays escaped."""
    with caplog.at_level(logging.WARNING, logger="omnitrace.config"):
        EncoderGraphConfig.from_hf_overrides({"max_graphs\n": 2})
    assert [r.getMessage() for r in caplog.records] == [
        "omnitrace: hf_overrides: max_graphs\\n: not an encoder graph option, so omnitrace "
        f"leaves it to the model; did you mean '{MAX}'?"
    ]


def test_a_refused_value_is_said_before_any_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A run refused for a bad value shows that one line, not a warning before it."""
    with (
        caplog.at_level(logging.WARNING, logger="omnitrace.config"),
        pytest.raises(ConfigError, match=r"^encoder_cuda_graph_max_graphs: expected"),
    ):
        EncoderGraphConfig.from_hf_overrides({"max_graphs": 2, MAX: -1})
    assert caplog.records == []


def test_misspelt_key_accepts_omnitraces_own_keys() -> None:
    """Every valid key is no misspelling."""
    assert [misspelt_key(key) for key in HF_OVERRIDE_KEYS] == [None] * len(HF_OVERRIDE_KEYS)


# -- the vLLM plugin's path: vLLM's model config ------------------------------------------------


def _vllm_config(hf_config: object, hf_overrides: object) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, hf_overrides=hf_overrides, enforce_eager=False
        )
    )


@pytest.mark.parametrize(
    "key",
    [
        "encoder_cudagraph_max_graphs",
        "encoder_cuda_grph_max_graphs",
        "encoder_cuda_graph_max_graph",
    ],
)
def test_the_plugin_refuses_a_misspelt_key_of_the_users_overrides(key: str) -> None:
    """vLLM sets every override on the hf config; the plugin reads the user's
    ``model_config.hf_overrides`` as given and refuses the misspelt key naming the right one."""
    hf_config = SimpleNamespace(hidden_size=64, **{key: 2})
    with pytest.raises(ConfigError, match=f"^{key}: unknown encoder graph option.*'{MAX}'\\?$"):
        config_from_model(SimpleNamespace(), _vllm_config(hf_config, {key: 2}))


def test_the_plugin_refuses_a_prefix_misspelt_in_the_hf_config_itself() -> None:
    """A key with omnitrace's prefix on the hf config (a config.json, or a vLLM that keeps
    no overrides) is refused too, never dropped."""
    hf_config = SimpleNamespace(encoder_cudagraph_max_graphs=2, encoder_layers=24)
    with pytest.raises(ConfigError, match=f"did you mean '{MAX}'"):
        config_from_model(SimpleNamespace(), _vllm_config(hf_config, None))
    model = SimpleNamespace(config={"encoder_cuda_graph_max_graph": 2})
    with pytest.raises(ConfigError, match=f"did you mean '{MAX}'"):
        config_from_model(model)


def test_the_plugin_warns_about_a_bare_name_and_ignores_the_models_own_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bare option name in the user's overrides is one logged warning; the model's own
    keys on the hf config, near ours or not, are not the user's and say nothing."""
    hf_config = SimpleNamespace(max_graphs=2, compile=True, encoder_graph=1, **{MAX: 3})
    with caplog.at_level(logging.WARNING, logger="omnitrace.config"):
        config = config_from_model(
            SimpleNamespace(), _vllm_config(hf_config, {"max_graphs": 2, MAX: 3})
        )
    assert config.max_graphs == 3
    assert [r.getMessage() for r in caplog.records] == [
        "omnitrace: hf_overrides: max_graphs: not an encoder graph option, so omnitrace "
        f"leaves it to the model; did you mean '{MAX}'?"
    ]


# -- the demo -----------------------------------------------------------------------------------


def test_the_demo_refuses_vllms_spelling_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--hf-overrides '{"encoder_cudagraph_max_graphs": 2}'` is exit 2 and one line, before
    the run (no event log written)."""
    events = tmp_path / "events.jsonl"
    overrides = json.dumps({"encoder_cudagraph_max_graphs": 2})
    argv = ["demo", "--no-tui", "--cpu", "--requests", "3", "--events-log", str(events)]
    assert main([*argv, "--hf-overrides", overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "omnitrace demo: error: --hf-overrides: encoder_cudagraph_max_graphs: unknown encoder "
        f"graph option ({SPELT}); did you mean '{MAX}'?"
    ]
    assert not events.exists()


def test_the_demo_warns_about_a_bare_name_and_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bare `max_graphs` runs with the default and says so first, in one status line."""
    events = tmp_path / "events.jsonl"
    argv = ["demo", "--no-tui", "--cpu", "--requests", "3", "--events-log", str(events)]
    assert main([*argv, "--hf-overrides", '{"max_graphs": 2}']) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "omnitrace: warning: --hf-overrides: max_graphs: not an encoder graph option, so "
        f"omnitrace leaves it to the model; did you mean '{MAX}'?"
    )
    assert sum("did you mean" in line for line in err) == 1
    summaries = [json.loads(line) for line in err if '"graph_summary"' in line]
    assert {s["max_graphs"] for s in summaries} == {DEFAULT.max_graphs}
