"""The colour channel's sequential ramp: viridis stops blended in OKLab at even
perceptual speed, so equal steps in value read as equal steps in colour."""

from __future__ import annotations

import math

#: Viridis stops, low to high.
VIRIDIS = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89",
           "#35b779", "#6ece58", "#b5de2b", "#fde725")


def _srgb_to_linear(c: float) -> float:
    return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4


def _linear_to_srgb(c: float) -> float:
    c = min(max(c, 0.0), 1.0)
    return 12.92 * c if c <= 0.0031308 else 1.055 * c ** (1 / 2.4) - 0.055


def hex_to_oklab(hex_color: str) -> tuple[float, float, float]:
    h = hex_color.lstrip("#")
    r, g, b = (_srgb_to_linear(int(h[i:i + 2], 16) / 255) for i in (0, 2, 4))
    l = 0.4122214708 * r + 0.5363325363 * g + 0.0514459929 * b
    m = 0.2119034982 * r + 0.6806995451 * g + 0.1073969566 * b
    s = 0.0883024619 * r + 0.2817188376 * g + 0.6299787005 * b
    l, m, s = (math.copysign(abs(v) ** (1 / 3), v) for v in (l, m, s))
    return (0.2104542553 * l + 0.7936177850 * m - 0.0040720468 * s,
            1.9779984951 * l - 2.4285922050 * m + 0.4505937099 * s,
            0.0259040371 * l + 0.7827717662 * m - 0.8086757660 * s)


def oklab_to_hex(lab: tuple[float, float, float]) -> str:
    L, a, b = lab
    l = (L + 0.3963377774 * a + 0.2158037573 * b) ** 3
    m = (L - 0.1055613458 * a - 0.0638541728 * b) ** 3
    s = (L - 0.0894841775 * a - 1.2914855480 * b) ** 3
    r = 4.0767416621 * l - 3.3077115913 * m + 0.2309699292 * s
    g = -1.2684380046 * l + 2.6097574011 * m - 0.3413193965 * s
    bb = -0.0041960863 * l - 0.7034186147 * m + 1.7076147010 * s
    return "#" + "".join(f"{round(_linear_to_srgb(c) * 255):02x}" for c in (r, g, bb))


class Ramp:
    """A stop list blended in OKLab, parameterised by perceptual arc length."""

    def __init__(self, stops: tuple[str, ...] = VIRIDIS, steps: int = 256) -> None:
        labs = [hex_to_oklab(s) for s in stops]
        seg = [math.dist(labs[i], labs[i + 1]) for i in range(len(labs) - 1)]
        total = sum(seg) or 1.0
        cum = [0.0]
        for d in seg:
            cum.append(cum[-1] + d / total)
        self._lut = []
        j = 0
        for k in range(steps):
            t = k / (steps - 1)
            while j < len(seg) - 1 and cum[j + 1] < t:
                j += 1
            span = cum[j + 1] - cum[j] or 1.0
            u = min(max((t - cum[j]) / span, 0.0), 1.0)
            lab = tuple(labs[j][c] + (labs[j + 1][c] - labs[j][c]) * u for c in range(3))
            self._lut.append(oklab_to_hex(lab))

    def __call__(self, t: float) -> str:
        """The colour at `t` in [0, 1] (0 = first stop)."""
        t = min(max(t, 0.0), 1.0)
        return self._lut[round(t * (len(self._lut) - 1))]


_DEFAULT: Ramp | None = None


def default_ramp() -> Ramp:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Ramp()
    return _DEFAULT


def is_dark(hex_color: str) -> bool:
    """Whether text on this fill should be light (OKLab lightness below the midpoint)."""
    return hex_to_oklab(hex_color)[0] < 0.62
