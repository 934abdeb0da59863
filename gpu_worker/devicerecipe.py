"""The presets of gpu_worker/photos.py as arithmetic on batches of arrays, for a GPU worker: Pillow's bilinear
resize and crop, the opennsfw recipe's JPEG round trip, channel order, normalisation and layout.

Written against the operations numpy and torch share (``xp`` is either module; images are [N, 3, H, W] RGB,
float, integers 0..255), so the same code runs batched on a GPU worker's stream and is checked here, with
numpy, against the CPU recipe (tests/test_devicerecipe.py).

The resize is Pillow's own: its fixed-point coefficients (``pillow_weights``), the horizontal pass rounded to
8 bits, then the vertical, each a matrix product in float64 where every term is an integer, so the sums are
exact in any order. A JPEG round trip's Huffman coding is lossless, so the pixels that come back from
Pillow's ``save(buf, "JPEG")`` and ``open(buf)`` are those of libjpeg's colour conversion, 2x2 chroma averaging,
8x8 DCT, quantization with the IJG tables at quality 75, inverse DCT, "fancy" (triangular) chroma upsampling
and colour conversion back, which ``JpegRoundTrip`` computes in libjpeg's own fixed-point arithmetic (its ISLOW
DCTs, 16-bit colour tables, rounding biases), each step an integer in float64: on real photographs all but a
few pixels in a million come out as Pillow's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

QUALITY = 75  # Pillow's default, libjpeg's jpeg_set_defaults

# ITU T.81 Annex K, as libjpeg's jcparam.c, in natural (row-major) order
_LUMA = np.array([
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99], dtype=np.int64).reshape(8, 8)
_CHROMA = np.full((8, 8), 99, dtype=np.int64)
_CHROMA[:4, :4] = np.array([[17, 18, 24, 47], [18, 21, 26, 66], [24, 26, 56, 99], [47, 66, 99, 99]])


def quant_table(base: np.ndarray, quality: int = QUALITY) -> np.ndarray:
    """libjpeg's jpeg_set_quality: the base table scaled, each entry 1..255 (baseline)."""
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    out: np.ndarray = np.clip((base * scale + 50) // 100, 1, 255).astype(np.float32)
    return out


class JpegRoundTrip:
    """``__call__(x)``: RGB [N, 3, H, W] float64 (integers 0..255, H and W multiples of 16) through Pillow's JPEG
    save and load."""

    def __init__(self, xp: Any, const: Callable[[np.ndarray], Any] = lambda a: a, quality: int = QUALITY) -> None:
        """``xp``: numpy or torch; ``const`` turns a numpy constant into one of ``xp``'s arrays (on its device)."""
        self.xp = xp
        self.q_luma = const(quant_table(_LUMA, quality))
        self.q_chroma = const(quant_table(_CHROMA, quality))
        self._bias: dict[int, Any] = {}
        self._const = const

    def __call__(self, rgb: Any) -> Any:
        y, cb, cr = _rgb_to_ycc(self.xp, rgb[:, 0], rgb[:, 1], rgb[:, 2])
        y = self._lossy(y, self.q_luma)
        cb = _upsample_h2v2(self.xp, self._lossy(self._downsample(cb), self.q_chroma))
        cr = _upsample_h2v2(self.xp, self._lossy(self._downsample(cr), self.q_chroma))
        return _ycc_to_rgb(self.xp, y, cb, cr)

    def _downsample(self, c: Any) -> Any:
        """libjpeg's h2v2_downsample: each 2x2 sum plus a bias of 1, 2, 1, 2... along the row, shifted by 2."""
        w = c.shape[-1] // 2
        bias = self._bias.get(w)
        if bias is None:
            bias = self._bias[w] = self._const(np.tile(np.array([1.0, 2.0], dtype=np.float32), w // 2 + 1)[:w])
        s = c[..., 0::2, 0::2] + c[..., 0::2, 1::2] + c[..., 1::2, 0::2] + c[..., 1::2, 1::2]
        return self.xp.floor((s + bias) / 4)

    def _lossy(self, plane: Any, q: Any) -> Any:
        """libjpeg's path of one plane: level shift, ISLOW forward DCT, quantization (its divisor is 8 times the
        table's, rounded half away from zero), dequantization, ISLOW inverse DCT, range limit."""
        xp = self.xp
        n, h, w = plane.shape
        blocks = (plane - 128.0).reshape(n, h // 8, 8, w // 8, 8).swapaxes(2, 3)  # [n, rows, cols, y, x]
        coef = _islow(xp, _islow(xp, blocks, -1, _FDCT, 1), -2, _FDCT, 2)
        d = 8.0 * q
        coef = xp.sign(coef) * xp.floor((xp.abs(coef) + d / 2) / d) * q
        back = _islow(xp, _islow(xp, coef, -2, _IDCT, 1), -1, _IDCT, 2)
        return (back + 128.0).clip(0.0, 255.0).swapaxes(2, 3).reshape(n, h, w)


# libjpeg's ISLOW DCTs (jfdctint.c, jidctint.c): 13-bit constants, PASS1_BITS = 2
_CONST_BITS, _PASS1_BITS = 13, 2
_FDCT, _IDCT = "fdct", "idct"
_F0298, _F0390, _F0541, _F0765, _F0899, _F1175 = 2446, 3196, 4433, 6270, 7373, 9633
_F1501, _F1847, _F1961, _F2053, _F2562, _F3072 = 12299, 15137, 16069, 16819, 20995, 25172


def _descale(xp: Any, x: Any, n: int) -> Any:
    return xp.floor((x + float(1 << (n - 1))) / float(1 << n))


def _odd(a: Any, b: Any, c: Any, d: Any) -> tuple[Any, Any, Any, Any]:
    """The odd part shared by both DCTs: (tmp4, tmp5, tmp6, tmp7) in jfdctint's names, from the differences
    (or in jidctint, the inputs 7, 5, 3, 1) ``a, b, c, d``."""
    z1, z2, z3, z4 = a + d, b + c, a + c, b + d
    z5 = (z3 + z4) * _F1175
    z1, z2 = z1 * -_F0899, z2 * -_F2562
    z3, z4 = z3 * -_F1961 + z5, z4 * -_F0390 + z5
    return a * _F0298 + z1 + z3, b * _F2053 + z2 + z4, c * _F3072 + z2 + z3, d * _F1501 + z1 + z4


def _islow(xp: Any, x: Any, axis: int, kind: str, pass_no: int) -> Any:
    """One pass of libjpeg's ISLOW forward or inverse DCT along ``axis`` (-1 or -2) of [..., 8, 8] integers."""
    v = [x[..., k] if axis == -1 else x[..., k, :] for k in range(8)]
    if kind == _FDCT:
        t0, t7, t1, t6, t2, t5, t3, t4 = (v[0] + v[7], v[0] - v[7], v[1] + v[6], v[1] - v[6], v[2] + v[5],
                                          v[2] - v[5], v[3] + v[4], v[3] - v[4])
        t10, t13, t11, t12 = t0 + t3, t0 - t3, t1 + t2, t1 - t2
        n = _CONST_BITS - _PASS1_BITS if pass_no == 1 else _CONST_BITS + _PASS1_BITS
        z1 = (t12 + t13) * _F0541
        o4, o5, o6, o7 = _odd(t4, t5, t6, t7)
        even = [t10 + t11, t10 - t11]
        if pass_no == 1:
            e0, e4 = (e * float(1 << _PASS1_BITS) for e in even)
        else:
            e0, e4 = (_descale(xp, e, _PASS1_BITS) for e in even)
        out = [e0, _descale(xp, o7, n), _descale(xp, z1 + t13 * _F0765, n), _descale(xp, o6, n), e4,
               _descale(xp, o5, n), _descale(xp, z1 + t12 * -_F1847, n), _descale(xp, o4, n)]
    else:
        z1 = (v[2] + v[6]) * _F0541
        t2, t3 = z1 + v[6] * -_F1847, z1 + v[2] * _F0765
        t0, t1 = (v[0] + v[4]) * float(1 << _CONST_BITS), (v[0] - v[4]) * float(1 << _CONST_BITS)
        t10, t13, t11, t12 = t0 + t3, t0 - t3, t1 + t2, t1 - t2
        o0, o1, o2, o3 = _odd(v[7], v[5], v[3], v[1])
        n = _CONST_BITS - _PASS1_BITS if pass_no == 1 else _CONST_BITS + _PASS1_BITS + 3
        out = [_descale(xp, a, n) for a in (t10 + o3, t11 + o2, t12 + o1, t13 + o0, t13 - o0, t12 - o1,
                                             t11 - o2, t10 - o3)]
    return xp.stack(out, axis)


def _rgb_to_ycc(xp: Any, r: Any, g: Any, b: Any) -> tuple[Any, Any, Any]:
    """libjpeg's rgb_ycc_convert (JFIF full range) in its 16-bit fixed point."""
    y = xp.floor((19595.0 * r + 38470.0 * g + 7471.0 * b + 32768.0) / 65536.0)
    cb = xp.floor((-11059.0 * r - 21709.0 * g + 32768.0 * b + (128 << 16) + 32767.0) / 65536.0)
    cr = xp.floor((32768.0 * r - 27439.0 * g - 5329.0 * b + (128 << 16) + 32767.0) / 65536.0)
    return y, cb, cr


def _ycc_to_rgb(xp: Any, y: Any, cb: Any, cr: Any) -> Any:
    """libjpeg's ycc_rgb_convert in its 16-bit fixed point, clamped to 0..255; [N, 3, H, W]."""
    cb, cr = cb - 128.0, cr - 128.0
    r = y + xp.floor((91881.0 * cr + 32768.0) / 65536.0)
    g = y + xp.floor((-22554.0 * cb - 46802.0 * cr + 32768.0) / 65536.0)
    b = y + xp.floor((116130.0 * cb + 32768.0) / 65536.0)
    return xp.stack([r, g, b], 1).clip(0.0, 255.0)


def _upsample_h2v2(xp: Any, c: Any) -> Any:
    """libjpeg's h2v2_fancy_upsample: each output sample 9/16, 3/16, 3/16, 1/16 of its four nearest inputs
    (edges repeated), with biases 8 and 7 on even and odd columns; [N, h, w] -> [N, 2h, 2w]."""
    up = xp.concatenate([c[:, :1], c[:, :-1]], 1)
    down = xp.concatenate([c[:, 1:], c[:, -1:]], 1)
    rows = xp.stack([3 * c + up, 3 * c + down], 2)  # [N, h, 2, w]: the column sums of each output row
    n, h, _two, w = rows.shape
    s = rows.reshape(n, 2 * h, w)
    left = xp.concatenate([s[..., :1], s[..., :-1]], 2)
    right = xp.concatenate([s[..., 1:], s[..., -1:]], 2)
    even = xp.floor((3 * s + left + 8) / 16)
    odd = xp.floor((3 * s + right + 7) / 16)
    return xp.stack([even, odd], 3).reshape(n, 2 * h, 2 * w)


# -- Pillow's bilinear resize ----------------------------------------------------------------------------------
PRECISION_BITS = 22  # Pillow's 8-bit resample: 32 - 8 - 2 bits of fraction in its integer coefficients
WEIGHTS_KEPT = 256  # coefficient matrices of this many (input, output) sizes stay on the device


def pillow_weights(n_in: int, n_out: int) -> np.ndarray:
    """Pillow's BILINEAR coefficients from ``n_in`` samples to ``n_out`` (Resample.c, precompute_coeffs and
    normalize_coeffs_8bpc, in its order of operations): [n_out, n_in] float64 of integers, each row summing to
    about 2**22."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = filterscale  # the bilinear filter's support is 1
    center = (np.arange(n_out, dtype=np.float64) + 0.5) * scale
    lo = np.maximum((center - support + 0.5).astype(np.int64), 0)[:, None]
    hi = np.minimum((center + support + 0.5).astype(np.int64), n_in)[:, None]
    x = np.arange(n_in)[None, :]
    w = np.maximum(0.0, 1.0 - np.abs((x - center[:, None] + 0.5) * (1.0 / filterscale)))
    w = np.where((x >= lo) & (x < hi), w, 0.0)
    total = np.cumsum(w, axis=1)[:, -1:]  # summed in order, as Pillow sums them
    k = np.divide(w, total, out=np.zeros_like(w), where=total != 0.0)
    out: np.ndarray = np.trunc(np.where(k < 0, -0.5, 0.5) + k * (1 << PRECISION_BITS))
    return out


def preset_geometry(preset: str, height: int, width: int, size: int = 224) -> tuple[int, int, int, int]:
    """(resized height, resized width, crop top, crop left) of a ``height`` x ``width`` image, as
    gpu_worker/photos.py's preset computes them."""
    if preset == "opennsfw":
        return 256, 256, 16, 16
    scale = 256 / min(width, height)
    w, h = max(256, round(width * scale)), max(256, round(height * scale))
    return h, w, (h - size) // 2, (w - size) // 2


class DeviceRecipe:
    """``__call__(x)``: a group of images of one size, [N, 3, H, W] float64 RGB 0..255, to the preset's rows,
    [N, 224, 224, 3] (or [N, 3, 224, 224] with ``nchw``) float64 (the caller's copy makes them float32). It is
    ``finish(crop(x))``: a batch of photos of many sizes takes ``crop`` once per size and ``finish`` once,
    so the launches that depend on the photos' count are the resize's alone."""

    def __init__(self, preset: str, nchw: bool, xp: Any, const: Callable[[np.ndarray], Any] = lambda a: a,
                 size: int = 224) -> None:
        """``xp``: numpy or torch; ``const`` turns a numpy constant into one of ``xp``'s arrays (on its device)."""
        self.preset = preset
        self.nchw = nchw
        self.xp = xp
        self.size = size
        self._const = const
        self._weights: OrderedDict[tuple[int, int], Any] = OrderedDict()  # the last WEIGHTS_KEPT sizes
        self.trip = JpegRoundTrip(xp, const) if preset == "opennsfw" else None
        std = np.array([0.229, 0.224, 0.225], dtype=np.float64)
        # opennsfw: BGR minus the mean; imagenet: RGB / 255, minus the mean, over std
        mul, add = (np.ones(3), -np.array([104.0, 117.0, 123.0])) if preset == "opennsfw" else (
            1.0 / (255.0 * std), -np.array([0.485, 0.456, 0.406]) / std)
        self.mul, self.add = const(mul.reshape(1, 3, 1, 1)), const(add.reshape(1, 3, 1, 1))

    def _w(self, n_in: int, n_out: int) -> Any:
        key = (n_in, n_out)
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = self._const(pillow_weights(n_in, n_out))
            if len(self._weights) > WEIGHTS_KEPT:
                self._weights.popitem(last=False)
        else:
            self._weights.move_to_end(key)
        return w

    def resize(self, x: Any, height: int, width: int) -> Any:
        """Pillow's ``resize((width, height), BILINEAR)``: horizontal pass first, each pass rounded to 0..255."""
        return self._resized(x, height, width, (0, height), (0, width))

    def _resized(self, x: Any, height: int, width: int, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
        """Rows ``rows`` and columns ``cols`` (start, stop) of ``resize(x, height, width)``: each output pixel
        has its own coefficients, so only those of the window are computed, and they equal the whole's."""
        if x.shape[-1] != width:
            x = self._pass(x @ self._w(x.shape[-1], width)[cols[0] : cols[1]].T)
        else:
            x = x[..., cols[0] : cols[1]]
        if x.shape[-2] != height:
            x = self._pass(self._w(x.shape[-2], height)[rows[0] : rows[1]] @ x)
        else:
            x = x[..., rows[0] : rows[1], :]
        return x

    @staticmethod
    def _pass(acc: Any) -> Any:
        """A pass's sums to 8 bits as Pillow's clip8: (sum + 2**21) >> 22. Its clamp to 0..255 is left out: the
        bilinear coefficients are non-negative and each output's sum to 2**22 within half a unit a tap, so a
        sum of 8-bit samples rounds to 0..255 already (one launch less per pass and photo)."""
        return (acc + float(1 << (PRECISION_BITS - 1))) // float(1 << PRECISION_BITS)

    def crop(self, x: Any) -> Any:
        """The per-size step: a group of images of one size, [N, 3, H, W] float64 RGB 0..255, resized and
        cropped as the preset does, [N, 3, size, size] (only the crop's pixels are computed)."""
        h, w, top, left = preset_geometry(self.preset, x.shape[-2], x.shape[-1], self.size)
        s = self.size
        return self._resized(x, h, w, (top, top + s), (left, left + s))

    def finish(self, x: Any) -> Any:
        """The batch step: ``crop``'s rows of any images, [N, 3, size, size], through the rest of the preset
        (the opennsfw JPEG round trip, channel order, normalisation) into its layout, float64."""
        if self.trip is not None:
            # RGB to BGR as a flip: an index list would upload itself, which no CUDA graph may capture
            x = self.xp.flip(self.trip(x), (1,))
        x = x * self.mul + self.add
        return x if self.nchw else self.xp.moveaxis(x, 1, 3)

    def __call__(self, x: Any) -> Any:
        return self.finish(self.crop(x))
