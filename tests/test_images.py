"""Images reach the processor as 8-bit RGB with their depth scaled, never clipped or truncated (issue 12.3).

Every expected pixel value is computed here from the definition (v * 255 / max, rounded to nearest), not with
the library's code; alpha compositing is checked against ``transformers``' own ``convert_to_rgb``.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack.data.chat import load_image


def rgb(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image).astype(np.int64)


def expected_grey(levels: np.ndarray, full_scale: int) -> np.ndarray:
    """Nearest 8-bit level of ``levels / full_scale``, replicated over R, G, B (exact integer arithmetic)."""
    nearest = np.array([[(2 * int(v) * 255 + full_scale) // (2 * full_scale) for v in row] for row in levels])
    return np.repeat(nearest[..., None], 3, axis=-1)


# 16-bit levels: bottom, values that saturated to 255 before (anything > 255), round-down / round-up cases, top.
LEVELS_16 = np.array([[0, 128, 129, 256], [257, 385, 386, 5000], [32767, 32768, 65278, 65535]], dtype=np.uint16)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_16_bit_png_is_scaled_not_saturated():
    encoded = png_bytes(Image.fromarray(LEVELS_16))
    assert Image.open(io.BytesIO(encoded)).mode == "I;16"  # the case of the bug report
    np.testing.assert_array_equal(rgb(load_image(encoded, "sample 0")), expected_grey(LEVELS_16, 65535))


@pytest.mark.parametrize("byte_order", ["<u2", ">u2"])
def test_uint16_arrays_are_scaled(byte_order):
    grey = LEVELS_16.astype(byte_order)
    np.testing.assert_array_equal(rgb(load_image(grey, "s")), expected_grey(LEVELS_16, 65535))
    colour = np.stack([LEVELS_16, LEVELS_16[::-1], np.full_like(LEVELS_16, 65535)], axis=-1)
    expected = np.stack([expected_grey(LEVELS_16, 65535)[..., 0], expected_grey(LEVELS_16[::-1], 65535)[..., 0],
                         np.full(LEVELS_16.shape, 255)], axis=-1)
    np.testing.assert_array_equal(rgb(load_image(colour, "s")), expected)


def test_float_in_unit_range_is_rounded_not_truncated():
    grid = np.arange(256, dtype=np.float64).reshape(16, 16) / 255.0  # every 8-bit level exactly
    np.testing.assert_array_equal(rgb(load_image(grid.astype(np.float32), "s"))[..., 0], np.arange(256).reshape(16, 16))
    # 0.999 * 255 = 254.745 -> 255 (truncation gives 254); 0.2 * 255 = 51 exactly; 0.01 * 255 = 2.55 -> 3
    probe = np.array([[0.999, 0.2], [0.01, 1.0]])
    np.testing.assert_array_equal(rgb(load_image(probe, "s"))[..., 0], [[255, 51], [3, 255]])
    tensor = torch.tensor(probe, dtype=torch.bfloat16)  # bfloat16 has no numpy dtype; still read
    assert rgb(load_image(tensor, "s"))[1, 1, 0] == 255


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array([[0.0, 2.4]]), r"sample 3, turn 1: float image values span \[0, 2.4\].*\[0, 1\]"),  # was {0,1,2}
        (np.array([[0.0, 255.0]], dtype=np.float32), r"sample 3, turn 1: .*Divide by 255"),
        (np.array([[-0.5, 0.5]]), r"sample 3, turn 1: float image values span \[-0.5, 0.5\]"),
        (np.array([[np.nan, 0.5]]), r"sample 3, turn 1: float image contains NaN"),
        (np.array([[np.inf, 0.5]]), r"sample 3, turn 1: float image contains NaN or infinity"),
        (np.array([[0, 300]], dtype=np.int32), r"sample 3, turn 1: int32 image values span \[0, 300\].*uint8"),
        (np.array([[-1, 3]], dtype=np.int64), r"sample 3, turn 1: int64 image values span \[-1, 3\]"),
        (np.zeros((3, 8, 8), dtype=np.uint8), r"sample 3, turn 1: image array has shape \(3, 8, 8\).*permute"),
        (np.zeros((2, 2), dtype=np.complex64), r"sample 3, turn 1: image array dtype complex64"),
    ],
)
def test_ambiguous_arrays_are_refused_with_the_sample_and_the_fix(array, message):
    with pytest.raises(ValueError, match=message):
        load_image(array, "sample 3, turn 1")


def test_wide_pil_modes():
    float_image = Image.fromarray(np.array([[0.0, 0.999]], dtype=np.float32))
    assert float_image.mode == "F"
    np.testing.assert_array_equal(rgb(load_image(float_image, "s"))[..., 0], [[0, 255]])
    with pytest.raises(ValueError, match=r"sample 2: float image values span"):
        load_image(Image.fromarray(np.array([[0.0, 7.0]], dtype=np.float32)), "sample 2")
    wide_int = Image.fromarray(np.array([[0, 70000]], dtype=np.int32))
    assert wide_int.mode == "I"
    with pytest.raises(ValueError, match=r"sample 2: int32 image values span \[0, 70000\]"):
        load_image(wide_int, "sample 2")


def test_eight_bit_integers_grey_and_bool_keep_their_values():
    levels = np.array([[0, 1, 127], [128, 254, 255]])
    for dtype in (np.uint8, np.int64, np.int16):  # int64 is what torch.randint gives
        np.testing.assert_array_equal(rgb(load_image(levels.astype(dtype), "s")), np.repeat(levels[..., None], 3, -1))
    np.testing.assert_array_equal(rgb(load_image(levels[..., None].astype(np.uint8), "s"))[..., 2], levels)
    np.testing.assert_array_equal(rgb(load_image(levels > 127, "s"))[..., 1], np.where(levels > 127, 255, 0))


def test_alpha_is_composited_onto_white_like_transformers():
    """transformers' convert_to_rgb rule (5.24: alpha composited onto white with PIL; 5.17 still drops alpha, so
    the reference is the rule written out, the same on every release)."""
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, size=(5, 7, 4), dtype=np.uint8)
    white = Image.new("RGBA", (7, 5), (255, 255, 255, 255))
    reference = np.asarray(Image.alpha_composite(white, Image.fromarray(rgba)).convert("RGB")).astype(np.int64)
    np.testing.assert_array_equal(rgb(load_image(rgba, "s")), reference)
    np.testing.assert_array_equal(rgb(load_image(png_bytes(Image.fromarray(rgba)), "s")), reference)
    # fully transparent pixels are white, not the colour hidden under alpha 0
    clear = np.zeros((2, 2, 4), dtype=np.uint8)
    assert (rgb(load_image(clear, "s")) == 255).all()
    grey_alpha = np.stack([np.full((2, 2), 100, np.uint16) * 257, np.full((2, 2), 65535, np.uint16)], -1)
    assert (rgb(load_image(grey_alpha, "s")) == 100).all()  # 16-bit grey + opaque alpha
