"""Make the test environment's torchvision (and timm) importable beside our CPU torch.

Why this exists: torchvision 0.28.0 is the release built for torch 2.13.0, and the only
Linux x86_64 wheel the package registry serves is a CUDA build. Its `_C.so` links
`libtorch_cuda.so`/`libc10_cuda.so`, which a CPU torch does not ship, so torchvision's own
loader gives up on its C ops (`extension._has_ops()` is False) and then fails on import at an
unguarded `register_fake("torchvision::nms")` ("operator torchvision::nms does not exist").
Everything else in the wheel (every model definition, transforms, box utilities) is Python.

What we do, and nothing more:
- The wheels live outside the venv's site-packages (`scripts/setup.sh` installs
  `requirements-vision.txt` with `--target .venv/vision`), so nothing imports torchvision by
  accident: the Hugging Face tests (transformers probes for torchvision) never see it.
- `import_torchvision()` puts that folder on `sys.path` and, before importing torchvision,
  defines the `torchvision::nms` and `torchvision::roi_align` operator schemas (the ones
  torchvision's detection models call) with CPU kernels: `roi_align` runs torchvision's own
  pure-Python `_roi_align` (its published fallback, "transcribed off the CUDA kernel",
  which torchvision itself would `torch.compile`; we run it eagerly), `nms` is a greedy NMS in
  numpy (sort by score, drop boxes whose IoU with a kept box exceeds the threshold), checked
  against an independent brute force in `tests/test_real_models.py`. The two ops stay single
  `torch.ops.torchvision.*` calls, so a captured detection graph has the shape it has with the
  C kernels; only the kernels' bits may differ from the CUDA wheel's C++ code.
- The other C ops (`ps_roi_*`, `deform_conv2d`, quantized variants, image decoding) stay
  unavailable and fail loudly as before.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {}


def vision_paths() -> list[Path]:
    """Folders holding the vision wheels: `$TORCHLENS_VISION_PATH` (os.pathsep-separated)
    or `<venv>/vision` as `scripts/setup.sh` installs it."""
    env = os.environ.get("TORCHLENS_VISION_PATH")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [Path(sys.prefix) / "vision"]


def available() -> bool:
    """True when a torchvision package is on the default import path or in `vision_paths()`."""
    if "torchvision" in sys.modules:
        return True
    return any((p / "torchvision" / "__init__.py").is_file() for p in vision_paths()) or \
        importlib.util.find_spec("torchvision") is not None


def _nms_cpu(dets: Any, scores: Any, iou_threshold: float) -> Any:
    """Greedy NMS: indices of kept boxes, highest score first (ties keep input order)."""
    import numpy as np
    import torch

    d = dets.detach().to(torch.float64).cpu().numpy()
    s = scores.detach().to(torch.float64).cpu().numpy()
    order = np.argsort(-s, kind="stable")
    x1, y1, x2, y2 = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    areas = (x2 - x1) * (y2 - y1)
    alive = np.ones(len(order), dtype=bool)
    keep = []
    for k, i in enumerate(order):
        if not alive[k]:
            continue
        keep.append(int(i))
        rest = order[k + 1:]
        w = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
        h = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
        inter = w * h
        with np.errstate(divide="ignore", invalid="ignore"):
            alive[k + 1:] &= ~(inter / (areas[i] + areas[rest] - inter) > iou_threshold)
    return torch.tensor(keep, dtype=torch.int64, device=dets.device)


def _define_ops() -> None:
    import torch

    if hasattr(torch.ops.torchvision, "nms") and "lib" not in _STATE:
        return  # a working torchvision build registered its own C ops
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
               "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor")
    lib.impl("nms", _nms_cpu, "CPU")

    def roi_align_cpu(inp, rois, spatial_scale, ph, pw, sampling_ratio, aligned):
        mod = importlib.import_module("torchvision.ops.roi_align")
        eager = getattr(mod._roi_align, "__wrapped__", mod._roi_align)  # skip its lazy torch.compile
        return eager(inp, rois, spatial_scale, ph, pw, sampling_ratio, aligned)

    lib.impl("roi_align", roi_align_cpu, "CPU")
    _STATE["lib"] = lib


def import_torchvision() -> Any:
    """Import torchvision (once), with the CPU kernels above when its `_C` cannot load."""
    if "torchvision" in _STATE:
        return _STATE["torchvision"]
    for p in reversed(vision_paths()):
        if p.is_dir() and str(p) not in sys.path:
            sys.path.append(str(p))  # after site-packages: a real install wins
    import torch  # noqa: F401  (the schemas below need the dispatcher)

    _define_ops()
    tv = importlib.import_module("torchvision")
    if "lib" in _STATE:  # our kernels serve the two ops; tell the two call sites so
        # by module path: `torchvision.ops.roi_align` the attribute is the function
        boxes = importlib.import_module("torchvision.ops.boxes")
        roi_align = importlib.import_module("torchvision.ops.roi_align")
        boxes._assert_has_ops = lambda: None
        roi_align._has_ops = lambda: True
        roi_align._assert_has_ops = lambda: None
    _STATE["torchvision"] = tv
    return tv


def import_timm() -> Any:
    """Import timm (pure Python; it imports torchvision, so that goes first)."""
    import_torchvision()
    return importlib.import_module("timm")


def c_ops_substituted() -> bool:
    """True when nms/roi_align run the kernels of this module, not torchvision's `_C`."""
    return "lib" in _STATE


__all__ = ["vision_paths", "available", "import_torchvision", "import_timm", "c_ops_substituted"]
