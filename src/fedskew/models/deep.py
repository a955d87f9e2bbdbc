"""The papers' larger image models (protocols.md, "Models"), each a backbone producing features z
plus the linear classifier of :class:`~fedskew.models.nets.SkewNet`.

* ``mlpnet``: MAP's MLPNet, 784-1024-1024-128 ReLU (the reference code; the paper's text says two
  512 layers: ``model.hidden=[512,512]``).
* ``tfcnn``: the FedAvg paper's CNN (McMahan et al., 2017): conv 32@5 - pool - conv 64@5 - pool -
  fc 512 (same padding).
* ``vgg8``, ``vgg8bn``, ``vgg11``, ``vgg16bn``: CIFAR VGGs, 3x3 convs (with BatchNorm for ``*bn``),
  max-pools after each stage, then fc 512 - fc 512 (ReLU, dropout 0.5 in train mode) and the
  classifier: VGG-n = n - 3 convs + 3 fully connected layers. vgg11 has 9,750,922 parameters for
  10 classes, the size the FL literature reports for its CIFAR-10 VGG-11 (FedNova, FedMA code).
* ``resnet18``: the CIFAR variant (3x3 stride-1 stem, no max-pool), 11,173,962 parameters for 10
  classes. ``resnet20``, ``resnet56``: He et al.'s 6n+2 CIFAR ResNets (16/32/64 channels; 0.27M and
  0.85M parameters). ``wrn28_10``: Wide ResNet 28-10 (Zagoruyko & Komodakis, 36.5M).
* ``resnet50``, ``efficientnet_b0``: torchvision's builders (no pretrained weights), the final
  fully connected layer replaced by the SkewNet classifier; torchvision is an optional extra.

Features are the global-average-pooled last feature map (ResNets, WRN, torchvision models) or the
last hidden fully connected layer (MLPNet, TF-CNN, VGGs).
"""

from __future__ import annotations

from torch import nn

from fedskew.models.nets import ModelError, SkewNet, StreamDropout, _spatial, mlp


def mlpnet(input_shape, num_classes, bias=True, hidden=(1024, 1024, 128)) -> SkewNet:
    return mlp(input_shape, num_classes, bias, hidden)


def tfcnn(input_shape, num_classes, bias=True) -> SkewNet:
    h, w = _spatial("tfcnn", input_shape, [(5, 2), (5, 2)])
    body = nn.Sequential(nn.Conv2d(input_shape[0], 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * h * w, 512), nn.ReLU())
    return SkewNet(body, 512, num_classes, bias)


# ---------------------------------------------------------------------------------------------
# VGG

_VGG = {"vgg8": [64, "M", 128, "M", 256, "M", 512, "M", 512, "M"],
        "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
        "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]}


def _vgg(name: str, input_shape, num_classes, bias, batch_norm: bool) -> SkewNet:
    cfg = _VGG[name]
    pools = cfg.count("M")
    size = input_shape[-1]
    if len(input_shape) != 3 or size < 2 ** pools or size % 2 ** pools or input_shape[-2] != size:
        raise ModelError(f"model '{name}{'bn' if batch_norm else ''}' needs square images whose side is a "
                         f"multiple of {2 ** pools} (CIFAR's 32x32), not input shape {tuple(input_shape)}.")
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers.append(nn.Conv2d(channels, v, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU(inplace=False))
        channels = v
    side = size // 2 ** pools
    layers += [nn.Flatten(), StreamDropout(0.5), nn.Linear(channels * side * side, 512), nn.ReLU(),
               StreamDropout(0.5), nn.Linear(512, 512), nn.ReLU()]
    return SkewNet(nn.Sequential(*layers), 512, num_classes, bias)


def vgg8(input_shape, num_classes, bias=True):
    return _vgg("vgg8", input_shape, num_classes, bias, False)


def vgg8bn(input_shape, num_classes, bias=True):
    return _vgg("vgg8", input_shape, num_classes, bias, True)


def vgg11(input_shape, num_classes, bias=True):
    return _vgg("vgg11", input_shape, num_classes, bias, False)


def vgg16bn(input_shape, num_classes, bias=True):
    return _vgg("vgg16", input_shape, num_classes, bias, True)


# ---------------------------------------------------------------------------------------------
# ResNets


class BasicBlock(nn.Module):
    """3x3 - BN - ReLU - 3x3 - BN, plus the shortcut (a 1x1 conv + BN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


class WideBlock(nn.Module):
    """Pre-activation wide block: BN - ReLU - 3x3 - (dropout) - BN - ReLU - 3x3, plus shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float = 0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.dropout = StreamDropout(dropout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride, 1, bias=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False))

    def forward(self, x):
        out = self.dropout(self.conv1(self.bn1(x).relu()))
        out = self.conv2(self.bn2(out).relu())
        return out + self.shortcut(x)


def _stages(block, widths: list[int], blocks: int, cin: int, **kw) -> tuple[nn.Sequential, int]:
    layers = []
    for i, width in enumerate(widths):
        for j in range(blocks):
            layers.append(block(cin, width, 2 if (i > 0 and j == 0) else 1, **kw))
            cin = width
    return nn.Sequential(*layers), cin


def _check_image(name: str, input_shape) -> None:
    if len(input_shape) != 3 or min(input_shape[1:]) < 8:
        raise ModelError(f"model '{name}' needs images of at least 8x8 pixels, not input shape {tuple(input_shape)}.")


def resnet18(input_shape, num_classes, bias=True) -> SkewNet:
    """ResNet-18 for CIFAR: 3x3 stride-1 stem with 64 channels, no max-pool, stages of two basic
    blocks with 64/128/256/512 channels, global average pooling (features 512)."""
    _check_image("resnet18", input_shape)
    stages, _ = _stages(BasicBlock, [64, 128, 256, 512], 2, 64)
    body = nn.Sequential(nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SkewNet(body, 512, num_classes, bias)


def _cifar_resnet(name: str, depth: int, input_shape, num_classes, bias) -> SkewNet:
    """He et al.'s 6n+2 CIFAR ResNet: 3x3 stem with 16 channels, three stages of n basic blocks
    with 16/32/64 channels (projection shortcuts), global average pooling (features 64)."""
    _check_image(name, input_shape)
    n = (depth - 2) // 6
    stages, cout = _stages(BasicBlock, [16, 32, 64], n, 16)
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SkewNet(body, cout, num_classes, bias)


def resnet20(input_shape, num_classes, bias=True):
    return _cifar_resnet("resnet20", 20, input_shape, num_classes, bias)


def resnet56(input_shape, num_classes, bias=True):
    return _cifar_resnet("resnet56", 56, input_shape, num_classes, bias)


def wrn28_10(input_shape, num_classes, bias=True, *, dropout: float = 0.0) -> SkewNet:
    """WRN-28-10: 3x3 stem with 16 channels, three stages of 4 pre-activation wide blocks with
    160/320/640 channels, BN - ReLU, global average pooling (features 640)."""
    _check_image("wrn28_10", input_shape)
    stages, cout = _stages(WideBlock, [160, 320, 640], 4, 16, dropout=dropout)
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False), stages, nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SkewNet(body, cout, num_classes, bias)


# ---------------------------------------------------------------------------------------------
# torchvision builders (optional extra)


def _torchvision(name: str):
    try:
        import torchvision.models as tvm
    except ImportError:
        raise ModelError(f"model '{name}' is built by torchvision, which is not installed; install it with "
                         f"`pip install fedskew[vision]` (torch and torchvision versions must match).") from None
    return tvm


def resnet50(input_shape, num_classes, bias=True) -> SkewNet:
    """torchvision's ResNet-50 (no pretrained weights), its ``fc`` removed: features 2048."""
    net = _torchvision("resnet50").resnet50(weights=None)
    if input_shape[0] != 3:
        net.conv1 = nn.Conv2d(input_shape[0], 64, 7, 2, 3, bias=False)
    d = net.fc.in_features
    net.fc = nn.Identity()
    return SkewNet(net, d, num_classes, bias)


def efficientnet_b0(input_shape, num_classes, bias=True) -> SkewNet:
    """torchvision's EfficientNet-B0 (no pretrained weights), its classifier removed: features 1280."""
    net = _torchvision("efficientnet_b0").efficientnet_b0(weights=None)
    if input_shape[0] != 3:
        first = net.features[0][0]
        net.features[0][0] = nn.Conv2d(input_shape[0], first.out_channels, 3, 2, 1, bias=False)
    d = net.classifier[-1].in_features
    net.classifier = nn.Identity()
    return SkewNet(net, d, num_classes, bias)


DEEP_MODELS = {"mlpnet": mlpnet, "tfcnn": tfcnn, "vgg8": vgg8, "vgg8bn": vgg8bn, "vgg11": vgg11,
               "vgg16bn": vgg16bn, "resnet18": resnet18, "resnet20": resnet20, "resnet56": resnet56,
               "wrn28_10": wrn28_10, "resnet50": resnet50, "efficientnet_b0": efficientnet_b0}
