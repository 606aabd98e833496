"""torchvision's detection models train, checked against real CPU runs of the same step.

The real side gives each image the targets graphmem documents for a detection model trained
without them, made by tests/oracles.py (``detection_targets``), not by graphmem.  The losses
are summed as torchvision's reference training script sums them.
The prediction is an upper bound (which anchors and proposals match depends on values):
never below the real run, and the test says how far above it may be.

Needs a torchvision that loads with the installed torch (the registry's build for torch 2.13
does not: these tests then skip; see docs/coverage-torchvision.md for the virtualenv).
"""

from __future__ import annotations

import pytest
import torch

import graphmem
from tests.oracles import OPTIMIZERS, detection_targets, measure_training

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
try:
    torch.ops.torchvision.nms  # its operator library loads with this torch
except (AttributeError, RuntimeError):
    pytest.skip("torchvision's operators do not load with this torch", allow_module_level=True)

SIZE = 128
BOXES = 8
# model -> how far above the real run the bound may be (measured: see docs/coverage-torchvision.md)
MODELS = {"ssdlite320_mobilenet_v3_large": 0.0, "fcos_resnet50_fpn": 0.0, "retinanet_resnet50_fpn": 0.01,
          "fasterrcnn_mobilenet_v3_large_320_fpn": 0.15}


@pytest.mark.parametrize("name", list(MODELS))
def test_detection_training_is_a_bound_of_real_execution(name: str) -> None:
    kwargs = {"weights": None, "weights_backbone": None, "num_classes": 3}

    def build() -> torch.nn.Module:
        return torchvision.models.get_model(name, **kwargs)

    torch.manual_seed(0)
    images = torch.randn(2, 3, SIZE, SIZE)
    real = measure_training(build, [], OPTIMIZERS["sgd"], "auto",
                            kw_inputs={"images": images, "targets": detection_targets(images, BOXES)})
    report = graphmem.analyze(f"torchvision.models.detection:{name}", [f"images=2x3x{SIZE}x{SIZE}"], mode="train",
                              optimizer="sgd", kwargs=kwargs)
    assert report.train is not None
    assert real.peak_bytes <= report.train.peak_bytes <= real.peak_bytes * (1 + MODELS[name])
    assert any("no targets were given" in a for a in report.train.assumptions)
