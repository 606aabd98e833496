"""torchvision and timm for the coverage sweep (benchmarks/coverage.py --library torchvision|timm).

Every model of ``torchvision.models.list_models()`` (classification, segmentation, detection,
video, optical flow; the quantized ones need a quantized backend and are left out) and one
model of each of a set of timm families, built with random weights and 10 classes, with
inputs of the kind the model takes: images 2x3x64x64 (then 2x3x224x224 where a model
needs its training size), clips 2x3x8x64x64, image pairs for optical flow.  Detection models
take a batch of images; in training graphmem makes their targets (graphmem.trace.values.targets) and
the real run gets the same ones (tests/oracles.py, ``detection_targets``).

    python benchmarks/coverage.py --library torchvision --write docs/coverage-vision.md
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# an input: (keyword, shape, kind), kind as benchmarks/coverage.py's Input takes it
Inputs = list[tuple[str, tuple[int, ...], str]]

# one per family, small members first: convolutional, transformer, MLP and hybrid designs
TIMM_MODELS = (
    "resnet18", "resnetv2_50", "efficientnet_b0", "mobilenetv3_small_100", "mobilenetv4_conv_small",
    "convnext_atto", "convnextv2_atto", "regnetx_002", "regnety_002", "densenet121", "dla34", "dpn68",
    "ghostnet_100", "hrnet_w18_small", "rexnet_100", "lcnet_050", "hgnet_tiny", "repvgg_a0", "cspresnet50",
    "nfnet_l0", "inception_v3", "xception41", "tresnet_m", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_ns_224", "levit_128s", "coat_lite_tiny", "cait_xxs24_224",
    "mixer_s16_224", "resmlp_12_224", "poolformer_s12", "efficientformer_l1", "mobilevit_xxs", "edgenext_xx_small",
    "fastvit_t8", "xcit_nano_12_p16_224", "pvt_v2_b0", "maxvit_nano_rw_256", "coatnet_nano_rw_224",
    "eva02_tiny_patch14_224", "beit_base_patch16_224", "tiny_vit_5m_224", "efficientvit_b0", "repvit_m1",
    "inception_next_tiny", "davit_tiny", "focalnet_tiny_srf", "gcvit_xxtiny", "nest_tiny", "twins_svt_small",
    "crossvit_tiny_240", "volo_d1_224", "visformer_tiny", "sequencer2d_s", "convmixer_768_32", "hiera_tiny_224",
)

_DETECTION = ("fasterrcnn", "maskrcnn", "keypointrcnn", "retinanet", "ssd", "ssdlite", "fcos")
_SEGMENTATION = ("fcn_", "deeplabv3", "lraspp")
_VIDEO = ("r3d_", "mc3_", "r2plus1d_", "s3d", "mvit_", "swin3d_")


def architectures(library: str) -> list[str]:
    """``library:name`` for every model the sweep builds from ``library``."""
    if library == "torchvision":
        import torchvision

        return [f"torchvision:{n}" for n in torchvision.models.list_models() if not n.startswith("quantized_")]
    if library == "timm":
        return [f"timm:{n}" for n in TIMM_MODELS]
    raise ValueError(f"unknown library {library!r}")


def task_of(name: str) -> str:
    if name.startswith(_DETECTION):
        return "detection"
    if name.startswith(_SEGMENTATION):
        return "segmentation"
    if name.startswith(_VIDEO):
        return "video"
    if name.startswith("raft"):
        return "optical flow"
    return "classification"


def architecture(model_type: str) -> tuple[Callable[[], Any], str, str, list[Inputs]]:
    """(build, class name, task, input variants) of ``library:name``."""
    library, _, name = model_type.partition(":")
    task = task_of(name) if library == "torchvision" else "classification"
    if library == "torchvision":
        import torchvision

        kwargs: dict[str, Any] = {"weights": None, "weights_backbone": None} if task in (
            "detection", "segmentation") else {"weights": None}
        if task in ("classification", "detection", "segmentation", "video"):
            kwargs["num_classes"] = 10 if task != "detection" else 3
        build = lambda: torchvision.models.get_model(name, **kwargs)
    else:
        import timm

        build = lambda: timm.create_model(name, pretrained=False, num_classes=10)
    variants = _variants(task)
    if name == "inception_v3":  # its auxiliary head (training) needs the 299 x 299 it was made for
        variants.append([("x", (2, 3, 299, 299), "float")])
    made_for = re.search(r"_(\d{3})$", name)  # timm's maxvit_nano_rw_256: windows that tile 256, not 224
    if library == "timm" and made_for and int(made_for.group(1)) not in (64, 224):
        size = int(made_for.group(1))
        variants.append([("x", (2, 3, size, size), "float")])
    if name.startswith("lraspp"):  # LRASPP.forward(self, input)
        variants = [[("input", shape, kind) for _, shape, kind in v] for v in variants]
    return build, name, task, variants


def _variants(task: str) -> list[Inputs]:
    if task == "video":
        return [[("x", (2, 3, 8, 64, 64), "float")], [("x", (2, 3, 16, 224, 224), "float")]]
    if task == "optical flow":
        return [[("image1", (1, 3, 128, 128), "float"), ("image2", (1, 3, 128, 128), "float")]]
    if task == "detection":
        return [[("images", (2, 3, 128, 128), "float")]]
    return [[("x", (2, 3, 64, 64), "float")], [("x", (2, 3, 224, 224), "float")]]
