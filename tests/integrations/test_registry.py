"""Model integrations: omnitrace's own modules, the omnitrace.models group, and the plugin."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from integrations.standins import build
from omnitrace.integrations import minicpmo, qwen2_5_omni, vllm_plugin
from omnitrace.integrations.base import ModelIntegration
from omnitrace.integrations.registry import (
    ENTRY_POINT_GROUP,
    IntegrationLoadError,
    builtin_entry_points,
    find_integration,
    model_integrations,
)

#: Models each probe integration was asked to instrument.
instrumented: list[tuple[str, Any]] = []


class ProbeModel(nn.Module):
    """A model only the probe integrations detect."""

    probe = True


def _probe(name: str) -> ModelIntegration:
    def instrument(model: Any, vllm_config: Any, *, bus: Any = None) -> Any:
        instrumented.append((name, model))
        return None

    return ModelIntegration(
        name=name,
        detect=lambda model: getattr(model, "probe", False),
        instrument=instrument,
        description=f"probe {name}",
    )


ALPHA = _probe("alpha")
BETA = _probe("beta")
NOT_AN_INTEGRATION = object()


def _entry(name: str, attr: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=f"{__name__}:{attr}", group=ENTRY_POINT_GROUP)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    instrumented.clear()


def test_builtin_integrations_are_found_from_their_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """omnitrace's own models are the modules here that publish INTEGRATION, with no metadata."""
    points = {ep.name: ep.value for ep in builtin_entry_points()}
    assert points["minicpmo"] == "omnitrace.integrations.minicpmo:INTEGRATION"
    assert points == {
        "minicpmo": "omnitrace.integrations.minicpmo:INTEGRATION",
        "qwen2_5_omni": "omnitrace.integrations.qwen2_5_omni:INTEGRATION",
    }
    assert {ep.group for ep in builtin_entry_points()} == {ENTRY_POINT_GROUP}
    monkeypatch.setattr(metadata, "entry_points", lambda **kwargs: metadata.EntryPoints())
    loaded = {integration.name: integration for integration in model_integrations()}
    assert loaded["minicpmo"] is minicpmo.INTEGRATION
    assert loaded == {"minicpmo": minicpmo.INTEGRATION, "qwen2_5_omni": qwen2_5_omni.INTEGRATION}


def test_metadata_still_declaring_a_builtin_loads_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An installed distribution that still declares omnitrace's own entry points (an older
    omnitrace's metadata) adds no second copy."""
    stale = metadata.EntryPoints(
        metadata.EntryPoint(name=ep.name, value=ep.value, group=ep.group)
        for ep in builtin_entry_points()
    )
    monkeypatch.setattr(metadata, "entry_points", lambda **kwargs: stale)
    assert model_integrations() == (minicpmo.INTEGRATION, qwen2_5_omni.INTEGRATION)


def test_integrations_load_in_entry_point_name_order_once_each() -> None:
    """Entries are sorted by name, and one declaration seen twice loads once."""
    points = [_entry("beta", "BETA"), _entry("alpha", "ALPHA"), _entry("beta", "BETA")]
    assert model_integrations(points) == (ALPHA, BETA)


def test_first_detecting_integration_in_name_order_wins() -> None:
    """Of two integrations that both detect a model, the first by name instruments it."""
    integrations = model_integrations([_entry("beta", "BETA"), _entry("alpha", "ALPHA")])
    assert find_integration(ProbeModel(), integrations) is ALPHA
    assert find_integration(nn.Linear(2, 2), integrations) is None


def test_builtin_detectors_claim_only_their_models() -> None:
    """MiniCPM-o's detector takes a vpm/apm model and leaves a plain module alone."""
    assert find_integration(build()) is minicpmo.INTEGRATION
    assert find_integration(nn.Linear(2, 2)) is None


def test_unloadable_entry_point_names_itself_and_the_fix() -> None:
    """An entry point whose module cannot be imported raises IntegrationLoadError naming it."""
    point = metadata.EntryPoint(
        name="ghost", value="no_such_module_xyz:INTEGRATION", group=ENTRY_POINT_GROUP
    )
    message = (
        "omnitrace.models entry point ghost = no_such_module_xyz:INTEGRATION cannot be loaded "
        "(ModuleNotFoundError: No module named 'no_such_module_xyz'); reinstall or remove "
        "the package that declares it"
    )
    with pytest.raises(IntegrationLoadError, match=re.escape(message)):
        model_integrations([point])


def test_entry_point_naming_something_else_is_rejected() -> None:
    """An entry point that loads an object other than a ModelIntegration is an error."""
    message = (
        f"omnitrace.models entry point odd = {__name__}:NOT_AN_INTEGRATION is a object, not "
        "an omnitrace.integrations.base.ModelIntegration"
    )
    with pytest.raises(IntegrationLoadError, match=re.escape(message)):
        model_integrations([_entry("odd", "NOT_AN_INTEGRATION")])


def test_empty_registry_warns_and_finds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """With no integrations registered, one warning says the group is empty."""
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        assert find_integration(build(), ()) is None
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "omnitrace: no model integrations are registered (entry-point group omnitrace.models "
        "is empty); reinstall omnitrace"
    ]


# -- the plugin ------------------------------------------------------------------------------


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another installed package declaring a model integration in its own metadata."""
    dist = tmp_path / "omnitrace_model_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: omnitrace-model-probe\nVersion: 0.0.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nalpha = {__name__}:ALPHA\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plugin_instruments_with_a_third_party_integration(
    third_party: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model integration another package registers is used by the plugin, omnitrace unchanged."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    model = ProbeModel()
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        vllm_plugin._after_load(model, None)
    assert instrumented == [("alpha", model)]
    attached = [r.getMessage() for r in caplog.records if "encoder graphs attached" in r.msg]
    assert len(attached) == 1
    assert "model=alpha" in attached[0]
    assert vllm_plugin._bus is not None
    vllm_plugin._bus.close()


def test_plugin_attaches_minicpmo_adapters_and_logs_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loaded MiniCPM-o model gets both adapters from the plugin, and one line says so."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    model = build()
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        vllm_plugin._after_load(model, None)
    assert model.vpm._encoder_graph is not None
    assert model._audio_encoder_graph is not None
    attached = [r.getMessage() for r in caplog.records if "encoder graphs attached" in r.msg]
    assert len(attached) == 1
    assert attached[0].startswith(
        "omnitrace: encoder graphs attached (vision=True, audio=True, "
        "audio_method=get_audio_hidden_states, vision_path=None, model=minicpmo, pid="
    )
    assert vllm_plugin._bus is not None
    vllm_plugin._bus.close()


def test_plugin_leaves_models_no_integration_detects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model no integration detects is returned untouched and no bus is made for it."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    model = nn.Linear(2, 2)
    vllm_plugin._after_load(model, None)
    assert vllm_plugin._bus is None
    assert "forward" not in vars(model)


def test_plugin_reports_an_unloadable_integration_as_a_plugin_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken model integration stops the load with a PluginError naming it and the way out."""
    point = metadata.EntryPoint(name="ghost", value="no_such_module_xyz:X", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        metadata, "entry_points", lambda **kwargs: [point] if kwargs else metadata.EntryPoints()
    )
    with pytest.raises(
        vllm_plugin.PluginError, match=r"ghost = no_such_module_xyz:X.*OMNITRACE_PLUGIN=0"
    ):
        vllm_plugin._after_load(ProbeModel(), None)


# -- discovery ---------------------------------------------------------------------------------

_GAMMA = """
from omnitrace.integrations.base import ModelIntegration

INTEGRATION = ModelIntegration(
    name="gamma",
    detect=lambda model: getattr(model, "gamma", False),
    instrument=lambda model, vllm_config, *, bus=None: None,
    description="a model in a package of integrations",
)
"""


@pytest.fixture
def models_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package of integration modules: one model, a helper that must not be imported."""
    name = f"probe_models_{tmp_path.name}".replace("-", "_")
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "gamma.py").write_text(_GAMMA)
    (root / "helpers.py").write_text(
        '"""INTEGRATION = in a docstring."""\nraise ImportError("helpers was imported")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in (name, f"{name}.gamma", f"{name}.helpers"):
        sys.modules.pop(module, None)


def test_a_module_publishing_integration_is_found_and_loaded(models_package: str) -> None:
    """A new module that assigns INTEGRATION is an integration, named after the module;
    modules that do not are never imported."""
    (point,) = builtin_entry_points(models_package)
    assert (point.name, point.value, point.group) == (
        "gamma",
        f"{models_package}.gamma:INTEGRATION",
        ENTRY_POINT_GROUP,
    )
    assert f"{models_package}.gamma" not in sys.modules
    (gamma,) = model_integrations([point])
    assert gamma.name == "gamma"
    model = nn.Linear(2, 2)
    model.gamma = True
    assert find_integration(model, (gamma,)) is gamma
    assert f"{models_package}.helpers" not in sys.modules


def test_third_party_and_builtin_integrations_share_one_name_order(third_party: None) -> None:
    """Another package's entry point joins omnitrace's own modules, sorted by name."""
    names = [integration.name for integration in model_integrations()]
    assert names == ["alpha", "minicpmo", "qwen2_5_omni"]
