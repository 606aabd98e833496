"""The output_bounds rules: at the count an input reaches when every element is kept (all
true, all distinct), each rule gives exactly the real CPU kernel's output shapes and dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import UserInputError
from graphmem.job.spec import parse_assumption
from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta, output_bounds

aten = torch.ops.aten
X = torch.arange(1, 61, dtype=torch.float32).reshape(3, 4, 5)  # every element non-zero and distinct
ALL = torch.ones(3, 4, 5, dtype=torch.bool)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ArgMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
    if isinstance(value, list):
        return [_meta(v) for v in value]
    return value


CASES = [
    (aten.nonzero.default, (X,)),
    (aten.masked_select.default, (X, ALL)),
    (aten.masked_select.default, (X, ALL[0])),  # broadcast mask
    (aten.index.Tensor, (X, [ALL])),
    (aten.index.Tensor, (X, [None, ALL[0, :, 0]])),
    (aten.index.Tensor, (X, [ALL[:, :, 0]])),
    (aten.index.Tensor, (X, [None, None, ALL[0, 0]])),
    (aten.index.Tensor, (X, [ALL[:, 0, 0], None, torch.tensor([0, 2, 4, 1, 3])[:3]])),  # not adjacent
    (aten._unique2.default, (X, True, False, False)),
    (aten._unique2.default, (X, True, True, True)),
    (aten.unique_consecutive.default, (X, True, True, None)),
    (aten.unique_consecutive.default, (X, True, True, 1)),
    (aten.unique_dim.default, (X, 2, True, False, False)),
    (aten.unique_dim.default, (X, -1, True, True, True)),
]


@pytest.mark.parametrize("op, args", CASES, ids=lambda v: str(v) if not isinstance(v, tuple) else "")
def test_the_bound_is_the_real_kernels_output_when_every_element_is_kept(op: Any, args: tuple[Any, ...]) -> None:
    real = op(*args)
    real = real if isinstance(real, tuple) else (real,)
    bound = output_bounds(rules_for("cpu").output_bounds[op], tuple(_meta(a) for a in args), {})
    assert bound.shapes(bound.count) == [tuple(t.shape) for t in real]
    assert [dtype for _, dtype in bound.outputs] == [t.dtype for t in real]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_device_has_the_bounds(device: str) -> None:
    assert aten.nonzero.default in rules_for(device).output_bounds


def test_nonzero_fraction_assumption() -> None:
    assert parse_assumption("nonzero=0.5") == ("nonzero", "0.5")
    assert parse_assumption("nonzero=0") == ("nonzero", "0.0")  # e.g. no outlier column in an int8 layer
    for bad in ("nonzero=-0.1", "nonzero=1.5", "nonzero=half"):
        with pytest.raises(UserInputError, match="fraction in"):
            parse_assumption(bad)


def test_rules_for_a_library_op_apply_once_the_library_registers_it() -> None:
    """A rule registered by name (torchvision::nms.default) is in force only when its op exists:
    graphmem imports without the library, and the rule applies once the model's code loaded it."""
    from graphmem.trace.rules.registry import register, rules_for

    @register("graphmem_test::keep_some.default", device="any", kind="output_bounds")
    def keep_some(args: Any, kwargs: Any) -> Any:
        raise AssertionError("not called here")

    names = lambda: {str(op) for op in rules_for("cpu").output_bounds}
    assert "graphmem_test.keep_some.default" not in names()
    library = torch.library.Library("graphmem_test", "DEF")
    library.define("keep_some(Tensor x) -> Tensor")
    assert "graphmem_test.keep_some.default" in names()


def test_nms_keeps_at_most_every_box() -> None:
    from graphmem.trace.rules.bounds import nms_bound

    bound = nms_bound((ArgMeta((1000, 4), torch.float32, (4, 1)), ArgMeta((1000,), torch.float32, (1,)), 0.7), {})
    assert bound.count == 1000 and bound.shapes(37) == [(37,)] and bound.outputs[0][1] == torch.int64


def test_detection_inference_bound_is_not_below_a_real_run() -> None:
    """Faster R-CNN (RPN proposals, NMS, box filtering): the bound holds over a real CPU run."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    from tests.oracles import measure_inference

    kwargs = dict(name="fasterrcnn_mobilenet_v3_large_320_fpn", weights=None, weights_backbone=None, num_classes=3)
    build = lambda: torchvision.models.get_model(**kwargs)
    report = graphmem.analyze(build, ["images=2x3x128x128"], mode="inference")
    assert report.inference is not None
    assert any("nms" in note and "upper bound" in note for note in report.inference.assumptions)
    measured = measure_inference(build, [], {"images": torch.rand(2, 3, 128, 128)})
    assert report.inference.peak_bytes >= measured.peak_bytes
