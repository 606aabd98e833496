"""torchvision's detection models train, checked against real CPU runs of the same step.

The real side gives each image the targets graphmem documents for a detection model trained
without them (graphmem.trace.targets), made here by the test itself: ``n`` boxes of half the
image's width and height on a grid, class 1, masks filling them, keypoints on their
diagonals.  The losses are summed as torchvision's reference training script sums them.
The prediction is an upper bound (which anchors and proposals match depends on values):
never below the real run, and the test says how far above it may be.

Needs a torchvision that loads with the installed torch (the registry's build for torch 2.13
does not: these tests then skip; see docs/coverage-torchvision.md for the virtualenv).
"""

from __future__ import annotations

import pytest
import torch

import graphmem
from tests.oracles import OPTIMIZERS, measure_training

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
try:
    torch.ops.torchvision.nms  # its operator library loads with this torch
except (AttributeError, RuntimeError):
    pytest.skip("torchvision's operators do not load with this torch", allow_module_level=True)

SIZE = 128
BOXES = 8
# model -> how far above the real run the bound may be (measured: see docs/coverage-torchvision.md)
MODELS = {"ssdlite320_mobilenet_v3_large": 0.0, "fasterrcnn_mobilenet_v3_large_320_fpn": 0.15}


def _targets(images: torch.Tensor, masks: bool) -> list[dict[str, torch.Tensor]]:
    height, width = images.shape[-2:]
    out = []
    for _ in range(images.shape[0]):
        corners = [(width * (k % 4) / 8, height * (k // 4 % 4) / 8) for k in range(BOXES)]
        target = {"boxes": torch.tensor([[x, y, x + width / 2, y + height / 2] for x, y in corners]),
                  "labels": torch.ones(BOXES, dtype=torch.int64)}
        if masks:
            target["masks"] = torch.zeros(BOXES, height, width, dtype=torch.uint8)
            for k, (x, y) in enumerate(corners):
                target["masks"][k, int(y):int(y + height / 2), int(x):int(x + width / 2)] = 1
        out.append(target)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_detection_training_is_a_bound_of_real_execution(name: str) -> None:
    kwargs = {"weights": None, "weights_backbone": None, "num_classes": 3}

    def build() -> torch.nn.Module:
        return torchvision.models.get_model(name, **kwargs)

    torch.manual_seed(0)
    images = torch.randn(2, 3, SIZE, SIZE)
    real = measure_training(build, [], OPTIMIZERS["sgd"], "auto",
                            kw_inputs={"images": images, "targets": _targets(images, masks=False)})
    report = graphmem.analyze(f"torchvision.models.detection:{name}", [f"images=2x3x{SIZE}x{SIZE}"], mode="train",
                              optimizer="sgd", kwargs=kwargs)
    assert report.train is not None
    assert real.peak_bytes <= report.train.peak_bytes <= real.peak_bytes * (1 + MODELS[name])
    assert any("no targets were given" in a for a in report.train.assumptions)
