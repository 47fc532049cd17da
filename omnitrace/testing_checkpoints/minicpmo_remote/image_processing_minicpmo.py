"""MiniCPM-o 4.5's image processor for a tiny test checkpoint (loaded with trust_remote_code): a
thumbnail plus a grid of slices, and the placeholder text vLLM counts the tokens of."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


def _size_of(image_size: Any) -> tuple[int, int]:
    """``(width, height)`` of a PIL size, vLLM's ImageSize, a list or a tensor."""
    if hasattr(image_size, "width") and hasattr(image_size, "height"):
        return int(image_size.width), int(image_size.height)
    width, height = (int(v) for v in list(image_size)[:2])
    return width, height


class MiniCPMOImageProcessor(BaseImageProcessor):
    """Thumbnail-plus-slices image processing of MiniCPM-V/o, at any resolution."""

    model_input_names: ClassVar[list[str]] = ["pixel_values"]

    def __init__(
        self,
        max_slice_nums: int = 9,
        scale_resolution: int = 448,
        patch_size: int = 14,
        image_feature_size: int = 64,
        use_image_id: bool = True,
        slice_mode: bool = True,
        norm_mean: Sequence[float] = (0.5, 0.5, 0.5),
        norm_std: Sequence[float] = (0.5, 0.5, 0.5),
        im_start: str = "<image>",
        im_end: str = "</image>",
        slice_start: str = "<slice>",
        slice_end: str = "</slice>",
        unk: str = "<unk>",
        im_id_start: str = "<image_id>",
        im_id_end: str = "</image_id>",
        version: float = 4.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_slice_nums = max_slice_nums
        self.scale_resolution = scale_resolution
        self.patch_size = patch_size
        self.image_feature_size = image_feature_size
        self.use_image_id = use_image_id
        self.slice_mode = slice_mode
        # Lists, not arrays: vLLM turns arrays into lists anyway so the processor hashes.
        self.norm_mean = [float(v) for v in norm_mean]
        self.norm_std = [float(v) for v in norm_std]
        self.im_start = self.im_start_token = im_start
        self.im_end = self.im_end_token = im_end
        self.slice_start = self.slice_start_token = slice_start
        self.slice_end = self.slice_end_token = slice_end
        self.unk = self.unk_token = unk
        self.im_id_start = im_id_start
        self.im_id_end = im_id_end
        self.version = version

    # -- sizes -------------------------------------------------------------------------------

    def _fit(self, width: float, height: float, upscale: bool) -> tuple[int, int]:
        """The size near ``scale_resolution`` squared (or smaller) with patch-multiple sides."""
        if upscale or width * height > self.scale_resolution**2:
            ratio = width / height
            height = self.scale_resolution / math.sqrt(ratio)
            width = height * ratio
        patch = self.patch_size
        return (
            max(patch, round(width / patch) * patch),
            max(patch, round(height / patch) * patch),
        )

    def get_sliced_grid(
        self, image_size: Any, max_slice_nums: int | None = None, nerver_split: bool = False
    ) -> tuple[int, int] | None:
        """``(columns, rows)`` of the slices of an image of ``image_size``; None for none."""
        width, height = _size_of(image_size)
        limit = self.max_slice_nums if max_slice_nums is None else max_slice_nums
        wanted = min(math.ceil(width * height / self.scale_resolution**2), limit)
        if nerver_split or not self.slice_mode or wanted <= 1:
            return None
        # Slice counts one either side of the area's, each split every way it factors; the
        # grid whose shape is nearest the image's aspect ratio (in log space) wins, the first
        # found on a tie, so the choice is deterministic.
        aspect = math.log(width / height)
        best: tuple[int, int] | None = None
        best_error = math.inf
        for count in (wanted - 1, wanted, wanted + 1):
            if count <= 1 or count > limit:
                continue
            for columns in range(1, count + 1):
                if count % columns:
                    continue
                rows = count // columns
                error = abs(aspect - math.log(columns / rows))
                if error < best_error:
                    best, best_error = (columns, rows), error
        return best

    def _slice_size(self, width: int, height: int, grid: tuple[int, int]) -> tuple[int, int]:
        columns, rows = grid
        return self._fit(width / columns, height / rows, upscale=True)

    # -- placeholders ------------------------------------------------------------------------

    def get_slice_image_placeholder(
        self,
        image_size: Any,
        image_idx: int = 0,
        max_slice_nums: int | None = None,
        use_image_id: bool | None = None,
    ) -> str:
        """The text an image stands for: thumbnail, then one line of slices per grid row."""
        grid = self.get_sliced_grid(image_size, max_slice_nums)
        tokens = self.unk * self.image_feature_size
        text = f"{self.im_start}{tokens}{self.im_end}"
        if grid is not None:
            columns, rows = grid
            line = f"{self.slice_start}{tokens}{self.slice_end}" * columns
            text += "\n" + "\n".join([line] * rows)
        use_id = self.use_image_id if use_image_id is None else use_image_id
        if use_id:
            text = f"{self.im_id_start}{image_idx}{self.im_id_end}{text}"
        return text

    # -- pixels ------------------------------------------------------------------------------

    def _patch_rows(self, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
        """One slice as ``(3, patch, patches * patch)``, patches in row-major order."""
        patch = self.patch_size
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        mean = np.asarray(self.norm_mean, dtype=np.float32)
        std = np.asarray(self.norm_std, dtype=np.float32)
        chw = torch.from_numpy(((pixels - mean) / std).transpose(2, 0, 1).copy())
        _, height, width = chw.shape
        rows, columns = height // patch, width // patch
        # (3, rows, patch, columns, patch) -> (3, patch, rows, columns, patch): patch k of the
        # flattened grid occupies columns [k * patch, (k + 1) * patch) of the result.
        grid = chw.reshape(3, rows, patch, columns, patch).permute(0, 2, 1, 3, 4)
        return grid.reshape(3, patch, rows * columns * patch), [rows, columns]

    def slice_image(
        self, image: Image.Image, max_slice_nums: int | None = None
    ) -> list[Image.Image]:
        """The thumbnail, then the slices row by row (none for a small image)."""
        width, height = image.size
        thumbnail = image.resize(self._fit(width, height, upscale=True), Image.Resampling.BICUBIC)
        grid = self.get_sliced_grid(image.size, max_slice_nums)
        if grid is None:
            return [thumbnail]
        columns, rows = grid
        cell_w, cell_h = self._slice_size(width, height, grid)
        whole = image.resize((cell_w * columns, cell_h * rows), Image.Resampling.BICUBIC)
        cells = [
            whole.crop((c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h))
            for r in range(rows)
            for c in range(columns)
        ]
        return [thumbnail, *cells]

    def preprocess(
        self,
        images: Any,
        do_pad: bool | None = True,
        max_slice_nums: int | None = None,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Slice and normalise each prompt's images (``images``: one list per prompt)."""
        if isinstance(images, Image.Image):
            batches = [[images]]
        elif images and isinstance(images[0], Image.Image):
            batches = [list(images)]
        else:
            batches = [list(group) for group in images]
        pixel_values: list[list[torch.Tensor]] = []
        tgt_sizes: list[torch.Tensor] = []
        image_sizes: list[torch.Tensor] = []
        for group in batches:
            slices: list[torch.Tensor] = []
            sizes: list[list[int]] = []
            for image in group:
                for part in self.slice_image(image, max_slice_nums):
                    rows, grid = self._patch_rows(part)
                    slices.append(rows)
                    sizes.append(grid)
            pixel_values.append(slices)
            tgt_sizes.append(torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2))
            image_sizes.append(
                torch.tensor([list(image.size) for image in group], dtype=torch.int64)
            )
        # Nested, variable-length lists: no tensor type for the batch.
        return BatchFeature(
            data={"pixel_values": pixel_values, "image_sizes": image_sizes, "tgt_sizes": tgt_sizes}
        )

    def __call__(self, images: Any, *args: Any, **kwargs: Any) -> BatchFeature:
        """Same as :meth:`preprocess`."""
        return self.preprocess(images, *args, **kwargs)
