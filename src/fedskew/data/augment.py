"""Standard CIFAR augmentation on tensors: random crop with zero padding and horizontal flip.

Every draw is a function of (seed, round, client, stage, position in the stage's sample stream),
so the sequential and the vectorised executor augment each sample identically. The crop and the
flip are one gather on the padded batch (no per-sample Python loop); with augmentation off
nothing runs at all.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.streams import numpy_rng


def crop_flip_params(seed: int, round_idx: int, client_id: int, stage: int, n: int, pad: int = 4) -> torch.Tensor:
    """[n, 3] int64: (row offset, column offset in 0..2*pad, flip 0/1) for the stage's n samples."""
    rng = numpy_rng(seed, "augment", round_idx, client_id, stage)
    return torch.from_numpy(np.stack([rng.integers(0, 2 * pad + 1, n), rng.integers(0, 2 * pad + 1, n),
                                      rng.integers(0, 2, n)], axis=1).astype(np.int64))


def crop_flip(x: torch.Tensor, params: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Crop each image of ``x`` [..., C, H, W] at its offsets from the zero-padded image and flip
    it horizontally where asked; ``params`` [..., 3] as from :func:`crop_flip_params`."""
    lead, (c, h, w) = x.shape[:-3], x.shape[-3:]
    flat = F.pad(x.reshape(-1, c, h, w), (pad, pad, pad, pad))
    p = params.reshape(-1, 3).to(x.device)
    rows = p[:, 0, None] + torch.arange(h, device=x.device)  # [N, H]
    cols = torch.arange(w, device=x.device)
    cols = torch.where(p[:, 2, None].bool(), w - 1 - cols, cols) + p[:, 1, None]  # [N, W]
    n = torch.arange(flat.shape[0], device=x.device)[:, None, None]
    out = flat[n, :, rows[:, :, None], cols[:, None, :]]  # [N, H, W, C]
    return out.permute(0, 3, 1, 2).reshape(*lead, c, h, w)
