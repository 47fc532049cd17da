"""Eligibility: one pure function names why a call must run eagerly, in a fixed order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnitrace.graphs.eligibility import examine, ineligible_detail, signature_of
from omnitrace.signature import InputSpec
from omnitrace.testing import SimulatedGraphBackend


def detail(*inputs: Any, enabled: bool = True, backend: Any = None) -> str | None:
    call = examine("vision", inputs)
    return ineligible_detail(call, enabled=enabled, backend=backend or SimulatedGraphBackend())


def test_an_eligible_call_has_no_detail() -> None:
    """Tensors on a graph device, no grad, no autocast, not capturing: eligible."""
    with torch.no_grad():
        assert detail(torch.ones(2), None) is None


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: detail(torch.ones(2), enabled=False), "disabled"),
        (lambda: detail(None, None), "no_tensors"),
        (lambda: detail(torch.ones(2), torch.ones(2, device="meta")), "mixed_devices"),
        (lambda: detail(torch.ones(2).to_sparse()), "layout"),
        (lambda: detail(torch.ones(2)), "grad"),
    ],
)
def test_each_reason_is_named(make: Any, expected: str) -> None:
    """Disabled, no tensors, mixed devices, layout and grad each get their detail."""
    assert make() == expected


def test_disabled_comes_before_every_other_reason() -> None:
    """A disabled adapter reports 'disabled' even for a call that is ineligible otherwise."""
    assert detail(None, enabled=False) == "disabled"


def test_autocast_and_capture_are_checked_after_grad() -> None:
    """Under no_grad, autocast on the device and an active capture are the reasons."""

    class Capturing(SimulatedGraphBackend):
        def is_capturing(self, device: torch.device) -> bool:
            return True

    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert detail(torch.ones(2)) == "autocast"
        assert detail(torch.ones(2), backend=Capturing()) == "capturing"


def test_a_device_the_backend_cannot_graph_is_named_by_its_type() -> None:
    """Inputs on a device the backend refuses report the device type."""

    class CudaOnly(SimulatedGraphBackend):
        def is_graph_device(self, device: torch.device) -> bool:
            return device.type == "cuda"

    with torch.no_grad():
        assert detail(torch.ones(2), backend=CudaOnly()) == "cpu"


def test_inputs_that_are_not_tensors_are_a_type_error() -> None:
    """A positional input that is neither a tensor nor None is refused by name and index."""
    with pytest.raises(TypeError, match=r"encoder graph 'vision' .* input 1 is a int"):
        examine("vision", (torch.ones(1), 3))


def test_signature_of_records_dtype_shape_device_and_stream() -> None:
    """The signature holds plain strings and ints, each input's own device, and the stream."""
    sig = signature_of((torch.ones(2, 3, dtype=torch.bfloat16), None), 5)
    assert sig.inputs == (InputSpec("bfloat16", (2, 3), "cpu"), None)
    assert sig.stream == 5
    assert sig.text == "bfloat16[2,3], None @cpu s=5"
