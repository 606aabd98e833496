"""torchvision's detection models train and infer, checked against real CPU runs of the same step.

The real side gives each image the targets graphmem documents for a detection model trained
without them, made by tests/oracles.py (``detection_targets``), not by graphmem.  The losses
are summed as torchvision's reference training script sums them.
The prediction is an upper bound (which anchors and proposals match depends on values):
never below the real run, and the test says how far above it may be.  Mask and Keypoint
R-CNN's heads run on the positive sampled proposals: the bound takes the sampler's own cap
(128 per image); a run from random weights has few (its 8 ground-truth boxes per image), so
their bound is the furthest above.  In inference, an R-CNN reads the sizes of the boxes it
predicts (pasting masks, keypoint heatmaps): taken as the whole image.

Needs a torchvision that loads with the installed torch (the registry's build for torch 2.13
does not: these tests then skip; see docs/coverage-torchvision.md for the virtualenv).
"""

from __future__ import annotations

import pytest
import torch

import graphmem
from graphmem.trace.values.targets import target_kinds
from tests.oracles import OPTIMIZERS, detection_targets, measure_inference, measure_training

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
try:
    torch.ops.torchvision.nms  # its operator library loads with this torch
except (AttributeError, RuntimeError):
    pytest.skip("torchvision's operators do not load with this torch", allow_module_level=True)

SIZE = 128
BOXES = 8
# model -> how far above the real run the bound may be (measured: see docs/coverage-torchvision.md)
MODELS = {"ssdlite320_mobilenet_v3_large": 0.0, "fcos_resnet50_fpn": 0.0, "retinanet_resnet50_fpn": 0.01,
          "fasterrcnn_mobilenet_v3_large_320_fpn": 0.15, "maskrcnn_resnet50_fpn": 0.25}
KWARGS = {"weights": None, "weights_backbone": None, "num_classes": 3}


@pytest.mark.parametrize("name", list(MODELS))
def test_detection_training_is_a_bound_of_real_execution(name: str) -> None:
    def build() -> torch.nn.Module:
        return torchvision.models.get_model(name, **KWARGS)

    torch.manual_seed(0)
    images = torch.randn(2, 3, SIZE, SIZE)
    targets = detection_targets(images, BOXES, *target_kinds(build()))
    real = measure_training(build, [], OPTIMIZERS["sgd"], "auto", kw_inputs={"images": images, "targets": targets})
    report = graphmem.analyze(f"torchvision.models.detection:{name}", [f"images=2x3x{SIZE}x{SIZE}"], mode="train",
                              optimizer="sgd", kwargs=KWARGS)
    assert report.train is not None
    assert real.peak_bytes <= report.train.peak_bytes <= real.peak_bytes * (1 + MODELS[name])
    assert any("no targets were given" in a for a in report.train.assumptions)


@pytest.mark.parametrize("name", ["maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"])
def test_rcnn_inference_reading_its_boxes_is_a_bound_of_real_execution(name: str) -> None:
    """Measured: equal to the byte on 128 x 128 images (2, two seeds), where the backbone holds
    the peak; above on 800 x 800, where pasting the masks does (docs/coverage-torchvision.md)."""
    report = graphmem.analyze(f"torchvision.models.detection:{name}", [f"images=2x3x{SIZE}x{SIZE}"],
                              mode="inference", kwargs=KWARGS)
    assert report.inference is not None
    assert any("sizes of the boxes it predicts" in a for a in report.inference.assumptions)
    for seed in range(2):
        torch.manual_seed(seed)
        real = measure_inference(lambda: torchvision.models.get_model(name, **KWARGS),
                                 [torch.randn(2, 3, SIZE, SIZE)])
        assert real.peak_bytes <= report.inference.peak_bytes <= real.peak_bytes * 1.01, seed
