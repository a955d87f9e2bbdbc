"""Models as backbone (features z) + linear classifier, the split every method addresses.

``model(x)`` returns logits; ``model(x, return_features=True)`` returns ``(z, logits)``. The
classifier is ``model.classifier`` (an ``nn.Linear``, with or without bias) and the backbone
``model.backbone``; parameter names start with ``backbone.`` or ``classifier.`` so that methods
can select the head or the body by name (FedRep, FedROD, FedBABU, ETF heads).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ModelError(ValueError):
    """A model that cannot be built for the given input shape."""


class SkewNet(nn.Module):
    def __init__(self, backbone: nn.Module, feature_dim: int, num_classes: int, bias: bool = True):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = feature_dim
        self.classifier = nn.Linear(feature_dim, num_classes, bias=bias)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z = self.backbone(x)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


def _conv_out(size: int, kernel: int, padding: int = 0, stride: int = 1) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _spatial(name: str, input_shape: tuple[int, ...], layers: list[tuple[int, int]]) -> tuple[int, int]:
    """Follow (kernel, padding) convs each followed by 2x2 max-pooling; error when the image vanishes."""
    if len(input_shape) != 3:
        raise ModelError(f"model.name '{name}' needs image inputs [C, H, W], got inputs of shape "
                         f"{tuple(input_shape)}; use model.name = 'mlp'.")
    h, w = input_shape[1:]
    for kernel, padding in layers:
        h, w = _conv_out(h, kernel, padding) // 2, _conv_out(w, kernel, padding) // 2
        if h < 1 or w < 1:
            raise ModelError(f"model.name '{name}' cannot take {input_shape[1]}x{input_shape[2]} images "
                             f"(the feature map vanishes); use a larger input or the 'tcnn'/'cnnbn'/'mlp' models.")
    return h, w


def mlp(input_shape, num_classes, bias=True, hidden=(200, 200)) -> SkewNet:
    """Flatten, then ``len(hidden)`` ReLU layers; features = the last hidden layer."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return SkewNet(nn.Sequential(*layers), width, num_classes, bias)


def lenet(input_shape, num_classes, bias=True) -> SkewNet:
    """MAP's LeNet: conv 16@5 - ReLU - pool - conv 16@5 - ReLU - pool; features = flattened map
    (256 on 28 px, 400 on 32 px)."""
    h, w = _spatial("lenet", input_shape, [(5, 0), (5, 0)])
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    return SkewNet(body, 16 * h * w, num_classes, bias)


def simplecnn(input_shape, num_classes, bias=True) -> SkewNet:
    """FedMR/MOON code's SimpleCNN: conv 6@5 - pool - conv 16@5 - pool - fc 120 - fc 84 (features 84)."""
    h, w = _spatial("simplecnn", input_shape, [(5, 0), (5, 0)])
    body = nn.Sequential(nn.Conv2d(input_shape[0], 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * h * w, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return SkewNet(body, 84, num_classes, bias)


def tcnn(input_shape, num_classes, bias=True) -> SkewNet:
    """FedKA's t-CNN: conv 32 - ReLU - pool - conv 64 - ReLU - pool - fc 512 - ReLU (features 512).
    The paper gives no kernel size: 3x3 with padding 1 here."""
    h, w = _spatial("tcnn", input_shape, [(3, 1), (3, 1)])
    body = nn.Sequential(nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * h * w, 512), nn.ReLU())
    return SkewNet(body, 512, num_classes, bias)


def cnnbn(input_shape, num_classes, bias=True, width=32) -> SkewNet:
    """A small CNN with BatchNorm: two (conv 3x3 - BN - ReLU - pool) blocks, then fc 128 - ReLU."""
    h, w = _spatial("cnnbn", input_shape, [(3, 1), (3, 1)])
    body = nn.Sequential(nn.Conv2d(input_shape[0], width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(2 * width * h * w, 128), nn.ReLU())
    return SkewNet(body, 128, num_classes, bias)


MODELS = {"mlp": mlp, "lenet": lenet, "simplecnn": simplecnn, "tcnn": tcnn, "cnnbn": cnnbn}


def build_model(cfg, input_shape: tuple[int, ...], num_classes: int) -> SkewNet:
    """Build the model of a :class:`fedskew.config.ModelConfig` for the data set's input shape."""
    if cfg.name not in MODELS:
        raise ModelError(f"model.name '{cfg.name}' is not known; allowed: {sorted(MODELS)}.")
    kwargs = {"bias": cfg.classifier_bias}
    if cfg.name == "mlp":
        kwargs["hidden"] = tuple(cfg.hidden)
    if cfg.name == "cnnbn":
        kwargs["width"] = cfg.width
    model = MODELS[cfg.name](tuple(input_shape), num_classes, **kwargs)
    if cfg.projection_dim:
        model = with_projection_head(model, cfg.projection_dim, num_classes, cfg.classifier_bias)
    return model


def with_projection_head(model: SkewNet, out_dim: int, num_classes: int, bias: bool = True) -> SkewNet:
    """MOON's architecture: backbone -> projection head (Linear d->d, ReLU, Linear d->out_dim) ->
    classifier. The features z are the projection's output."""
    d = model.feature_dim
    body = nn.Sequential(model.backbone, nn.Linear(d, d), nn.ReLU(), nn.Linear(d, out_dim))
    return SkewNet(body, out_dim, num_classes, bias)
