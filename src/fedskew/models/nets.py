"""Models as backbone (features z) + linear classifier, the split every method addresses.

``model(x)`` returns logits; ``model(x, return_features=True)`` returns ``(z, logits)``. The
classifier is ``model.classifier`` (an ``nn.Linear``, with or without bias) and the backbone
``model.backbone``; parameter names start with ``backbone.`` or ``classifier.`` so that methods
can select the head or the body by name (FedRep, FedROD, FedBABU, ETF heads).
"""

from __future__ import annotations

import copy
import math
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn


class ModelError(ValueError):
    """A model that cannot be built for the given input shape."""


# The mask source of StreamDropout layers in the current training call (None: torch's dropout).
DROPOUT_MASKS: ContextVar = ContextVar("fedskew_dropout_masks", default=None)


class StreamDropout(nn.Dropout):
    """``nn.Dropout`` whose training masks come from the executor's mask source (``DROPOUT_MASKS``):
    each client's masks are drawn from its own named stream (``dropout``, per round, client and
    stage), one layer after another in forward order, by :class:`GeneratorMasks` in the sequential
    executor and the same draws made ahead of each step by the vectorised one (:class:`BufferMasks`,
    which is how dropout runs under ``vmap``), so the two executors train on the same masks. With no
    source (outside training) it is ``nn.Dropout``. Same parameters and state as ``nn.Dropout``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = DROPOUT_MASKS.get()
        if not self.training or self.p == 0 or source is None:
            return super().forward(x)
        return x * source.mask(self.p, x)


UNIFORM = -1.0  # the "rate" of a StreamUniform: its stream draws uniform numbers, not a mask


class StreamUniform(StreamDropout):
    """Uniform [0, 1) numbers of its input's shape, drawn from the same per-client stream as
    StreamDropout's masks (so both executors draw the same, in forward order); None outside
    training or without a source. The randomness of a model that samples per step (Floco's
    point on the simplex, :class:`SimplexLinear`)."""

    def __init__(self):
        super().__init__(0.5)
        self.p = UNIFORM

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        source = DROPOUT_MASKS.get()
        return source.mask(self.p, x) if self.training and source is not None else None


def dropout_mask(p: float, shape, generator: torch.Generator) -> torch.Tensor:
    """One dropout mask (keep with probability 1 - p, kept entries scaled by 1 / (1 - p)), float32,
    drawn on the CPU from ``generator`` (the same bits on every device); for ``p = UNIFORM``
    (:class:`StreamUniform`) uniform [0, 1) numbers instead."""
    if p == UNIFORM:
        return torch.rand(tuple(shape), generator=generator)
    return torch.empty(tuple(shape)).bernoulli_(1 - p, generator=generator).div_(1 - p)


class GeneratorMasks:
    """Masks drawn as each StreamDropout asks, from one client's generator (sequential executor)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def mask(self, p: float, x: torch.Tensor) -> torch.Tensor:
        return dropout_mask(p, x.shape, self.generator).to(x.device, x.dtype)


class BufferMasks:
    """Masks drawn ahead (vectorised executor): a lane's flat ``buffer`` holds one block per
    StreamDropout call of a step, at the offsets ``blocks``; a call takes the first ``x.numel()``
    entries of its block (its rows first, so a lane that trains fewer rows than the block was
    drawn for takes exactly its own draws)."""

    def __init__(self, buffer: torch.Tensor, blocks: list[int]):
        self.buffer, self.blocks, self.calls = buffer, blocks, 0

    def mask(self, p: float, x: torch.Tensor) -> torch.Tensor:
        if self.calls >= len(self.blocks):
            raise ValueError(f"the loss runs the model in training mode more often per step than the "
                             f"{len(self.blocks)} dropout passes drawn for it")
        at = self.blocks[self.calls]
        self.calls += 1
        return self.buffer[at:at + x.numel()].view(x.shape).to(x.dtype)


class SkewNet(nn.Module):
    """``fixed_keys``: state entries that are part of the architecture, never trained and never
    exchanged (the ETF head); the federated state leaves them out."""

    def __init__(self, backbone: nn.Module, feature_dim: int, num_classes: int, bias: bool = True):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = feature_dim
        self.classifier: nn.Module = nn.Linear(feature_dim, num_classes, bias=bias)
        self.fixed_keys: frozenset[str] = frozenset()
        self.register_parameter("shift", None)  # FedDBE's PRBM (FedDBE.build_model): classifier(z + shift)
        self.valve: nn.Module | None = None  # GPFL's CoV (GPFL.build_model): classifier(valve(z))
        self.policy: nn.Module | None = None  # FedCP's CPN and global head (FedCP.build_model)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z = self.backbone(x)
        h = z if self.shift is None else z + self.shift
        if self.policy is not None:
            logits = self.policy(h, self.classifier)
        else:
            logits = self.classifier(h if self.valve is None else self.valve(h))
        return (z, logits) if return_features else logits


def valve_apply(x: torch.Tensor, context: torch.Tensor, p: dict) -> torch.Tensor:
    """GPFL's conditional valve (Zhang et al., ICCV 2023; TsingZ0/GPFL ``CoV``): ReLU(x (gamma(c) +
    1) + beta(c)), gamma and beta each LayerNorm(ReLU(Linear(c))); ``p`` the valve's tensors by
    name (``gamma.0.weight``, ``gamma.2.weight``, ...)."""

    def branch(name):
        h = F.relu(F.linear(context, p[f"{name}.0.weight"], p[f"{name}.0.bias"]))
        return F.layer_norm(h, h.shape[-1:], p[f"{name}.2.weight"], p[f"{name}.2.bias"])

    return F.relu(x * (branch("gamma") + 1) + branch("beta"))


class ConditionalValve(nn.Module):
    """:func:`valve_apply` with the context a buffer: the client's personalised conditional input
    p_k = sum_c (n_k,c / n_k) e_c over the received category embeddings (GPFL sets it each round)."""

    def __init__(self, d: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))
        self.beta = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))
        self.register_buffer("context", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return valve_apply(x, self.context, dict(self.named_parameters()))


class ConditionalPolicy(nn.Module):
    """FedCP's conditional policy (Zhang et al., KDD 2023; TsingZ0/FedCP ``ConditionalSelection``,
    ``Gate``, ``Ensemble``): the CPN, Linear(d, 2d) - LayerNorm(2d) - ReLU, reads the features z
    times the normalised client context c (a buffer: the row sum of the client's head weights) and
    gives two d-vectors per sample, a Gumbel-softmax (tau = 1, soft) over each pair: the policy
    (s_p, s_g), s_p + s_g = 1. Logits: head_p(z * s_p) + head_g(z * s_g), head_p the model's
    classifier (kept by the client) and head_g the global head. The Gumbel noise is drawn in train
    and eval mode alike, as the official gate draws it (torch's global generator: executors seed it)."""

    def __init__(self, d: int, num_classes: int, bias: bool = True):
        super().__init__()
        self.cpn = nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm([2 * d]), nn.ReLU())
        self.head_g = nn.Linear(d, num_classes, bias=bias)
        self.register_buffer("context", torch.zeros(d))

    def forward(self, z: torch.Tensor, head_p: nn.Module) -> torch.Tensor:
        s = self.cpn(z * F.normalize(self.context, dim=-1))
        policy = F.gumbel_softmax(s.unflatten(-1, (2, z.shape[-1])), tau=1.0, hard=False, dim=-2)
        return head_p(z * policy[..., 0, :]) + self.head_g(z * policy[..., 1, :])


def simplex_etf(feature_dim: int, num_classes: int, generator: torch.Generator) -> torch.Tensor:
    """A d x C simplex equiangular tight frame M = sqrt(C/(C-1)) P (I - 11^T/C), P a random d x C
    matrix with orthonormal columns (QR of a Gaussian matrix; neural-collapse paper, Eq. 1).
    Every column has unit norm and every pair of columns has cosine -1/(C-1)."""
    C = num_classes
    if feature_dim < C:
        raise ModelError(f"an ETF head needs feature dimension >= number of classes (d = {feature_dim} < C = {C})")
    q, r = torch.linalg.qr(torch.randn(feature_dim, C, generator=generator, dtype=torch.float64))
    p = q * torch.sign(torch.diagonal(r))  # a unique orthonormal basis for the drawn matrix
    m = math.sqrt(C / (C - 1)) * p @ (torch.eye(C, dtype=torch.float64) - torch.ones(C, C, dtype=torch.float64) / C)
    return m.to(torch.float32)


class ETFClassifier(nn.Module):
    """Fixed classifier logits = beta * M^T z (z L2-normalised first with ``normalize``). The
    weight is a buffer: no optimiser sees it; it is derived from the experiment seed, so the
    server and every client hold the same one without sending it.

    FedETF's head (Li et al., ICCV 2023) adds, with ``projector``, a trainable linear layer
    z -> W_p z + b_p before the normalisation (``classifier.projector.*``) and, with
    ``learn_scale``, beta as a trainable parameter ``classifier.scale`` (its learnable
    temperature) instead of a constant folded into the weight."""

    def __init__(self, feature_dim: int, num_classes: int, generator: torch.Generator, scale: float = 1.0,
                 normalize: bool = False, projector: bool = False, learn_scale: bool = False):
        super().__init__()
        etf = simplex_etf(feature_dim, num_classes, generator).T.contiguous()
        self.register_buffer("weight", etf if learn_scale else scale * etf)
        self.normalize = normalize
        self.projector = nn.Linear(feature_dim, feature_dim) if projector else None
        self.scale = nn.Parameter(torch.tensor(float(scale))) if learn_scale else None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.projector is not None:
            z = self.projector(z)
        if self.normalize:
            z = F.normalize(z, dim=-1)
        logits = z @ self.weight.T
        return logits if self.scale is None else self.scale * logits


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


def mlp(input_shape, num_classes, bias=True, hidden=(200, 200), dropout: float = 0.0) -> SkewNet:
    """Flatten, then ``len(hidden)`` ReLU layers, each followed by dropout ``dropout`` when it is > 0
    (:class:`StreamDropout`); features = the last hidden layer."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()] + ([StreamDropout(dropout)] if dropout > 0 else [])
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


class FixedLinear(nn.Module):
    """A linear head whose weight [C, d] and bias [C] are buffers, never trained (FedLoGe's SSE-C)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return F.linear(z, self.weight, self.bias)


def flat_units(module: nn.Module) -> list[nn.Module]:
    """A sequential backbone's layers in order, nested nn.Sequential containers opened (a ResNet's
    stage of residual blocks); None when the backbone is not sequential."""
    if not isinstance(module, nn.Sequential):
        return None
    units = []
    for child in module.children():
        units += flat_units(child) if isinstance(child, nn.Sequential) else [child]
    return units


PARAMETRIC = (nn.Linear, nn.modules.conv._ConvNd)
ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SiLU)


def level_blocks(units: list[nn.Module]) -> list[list[int]]:
    """The backbone's units cut into blocks (FedMLB's levels): a linear or convolutional layer after an
    activation starts a block (an MLP's hidden layers, a CNN's conv stages with their pooling); so does
    a residual block after the stem or one whose shortcut projects (a ResNet's stages); pooling,
    flattening and dropout join the block before."""
    blocks: list[list[int]] = []
    activated = residual = False
    for i, unit in enumerate(units):
        params = any(True for _ in unit.parameters())
        is_residual = params and not isinstance(unit, PARAMETRIC) and not isinstance(
            unit, nn.modules.batchnorm._NormBase) and not isinstance(unit, (nn.GroupNorm, nn.LayerNorm))
        projects = is_residual and any(True for _ in getattr(unit, "shortcut", nn.Sequential()).parameters())
        start = not blocks or (isinstance(unit, PARAMETRIC) and activated) or (
            is_residual and (not residual or projects))
        if start:
            blocks.append([])
            activated = residual = False
        blocks[-1].append(i)
        activated |= isinstance(unit, ACTIVATIONS) or is_residual
        residual |= is_residual
    return blocks


def as_buffers(module: nn.Module) -> nn.Module:
    """``module`` with every parameter turned into a buffer of the same name (a frozen copy)."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            delattr(m, name)
            m.register_buffer(name, p.detach().clone())
    return module


class BranchedNet(SkewNet):
    """FedMLB's architecture (Kim, Kim and Han, ICML 2022): the model, its sequential backbone cut
    into blocks (:func:`level_blocks`), and ``received``, a frozen copy of the model (buffers) that
    holds the model the client received. In train mode the logits are [B, (1 + S) C]: the model's,
    then for each backbone block k the hybrid pathway's, the model's blocks up to k followed by the
    received model's later blocks and classifier (eval mode); in eval mode the model's alone."""

    def __init__(self, model: SkewNet):
        nn.Module.__init__(self)
        units = flat_units(model.backbone)
        if units is None or any(getattr(model, k, None) is not None for k in ("shift", "valve", "policy")):
            raise ModelError("this model's backbone is not a sequence of layers")
        self.backbone, self.classifier = model.backbone, model.classifier
        self.feature_dim = model.feature_dim
        self.shift = self.valve = self.policy = None
        self.received = as_buffers(copy.deepcopy(model))
        self.fixed_keys = model.fixed_keys | {"received." + k for k in model.fixed_keys}
        self._units, self._received_units = units, flat_units(self.received.backbone)
        self.blocks = level_blocks(units)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        h, levels = x, []
        for block in self.blocks:
            for i in block:
                h = self._units[i](h)
            levels.append(h)
        logits = self.classifier(h)
        if self.training:
            was = self.received.training
            self.received.eval()
            try:
                hybrid = []
                for k, h in enumerate(levels):
                    for block in self.blocks[k + 1:]:
                        for i in block:
                            h = self._received_units[i](h)
                    hybrid.append(self.received.classifier(h))
            finally:
                self.received.train(was)
            out = torch.cat([logits, *hybrid], 1)
        else:
            out = logits
        return (levels[-1], out) if return_features else out


class Branches(nn.Module):
    """FedConcat's encoder (Diao, Li and He, AAAI 2024; ``CombineAllModel`` in the authors' code):
    K backbones side by side, features z = [z_1, ..., z_K] (K d). Parameter names
    ``backbone.branches.<k>.*``; a classifier over z is K blocks of d columns, block k reading
    branch k."""

    def __init__(self, backbones: list[nn.Module]):
        super().__init__()
        self.branches = nn.ModuleList(backbones)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], dim=1)


class PrivateExpertNet(SkewNet):
    """FLDA's architecture (Peterson et al., 2019, as the MAP authors' code builds it): the model
    (``backbone``, ``classifier``: the global model), a private model of the same configuration
    with its own initialisation (``private.*``) and a gate alpha(x) = sigmoid(w^T z + b) on the
    model's features z (``gate.*``). Logits: alpha * model logits + (1 - alpha) * private logits
    when the buffer ``gate_on`` is 1; the model's logits alone when it is 0 (the server's state
    keeps it 0, so the global model scores without the private parts it never receives)."""

    def __init__(self, model: SkewNet, private: SkewNet):
        nn.Module.__init__(self)
        self.backbone, self.classifier, self.feature_dim = model.backbone, model.classifier, model.feature_dim
        self.private = private
        self.gate = nn.Linear(model.feature_dim, 1)
        self.register_buffer("gate_on", torch.zeros(()))
        self.fixed_keys = model.fixed_keys | {"private." + k for k in private.fixed_keys}

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z = self.backbone(x)
        logits = self.classifier(z)
        alpha = torch.sigmoid(self.gate(z))
        mixed = alpha * logits + (1 - alpha) * self.private(x)
        logits = self.gate_on * mixed + (1 - self.gate_on) * logits  # (no branch: vmap-able)
        return (z, logits) if return_features else logits


class MixtureHead(nn.Module):
    """The mixture's log-probabilities from M learners' logits side by side ([B, M C]):
    log sum_m pi_m softmax(l_m), pi the buffer ``mix``."""

    def __init__(self, learners: int):
        super().__init__()
        self.register_buffer("mix", torch.full((learners,), 1.0 / learners))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        per = z.reshape(z.shape[0], len(self.mix), -1)
        return torch.logsumexp(torch.log(self.mix)[:, None] + F.log_softmax(per, -1), 1)


class MixtureNet(SkewNet):
    """FedEM's ensemble (Marfoq et al., 2021): M learners of one configuration (``learners.m.*``)
    and the mixture weights pi (``classifier.mix``). The features z are the learners' logits side
    by side ([B, M C]), which FedEM's loss reads; the logits are the mixture's log-probabilities
    (:class:`MixtureHead`), so cross-entropy and argmax score the mixture."""

    def __init__(self, learners: list[SkewNet]):
        nn.Module.__init__(self)
        self.learners = nn.ModuleList(learners)
        self.feature_dim = len(learners) * learners[0].classifier.out_features
        self.classifier = MixtureHead(len(learners))
        self.fixed_keys = frozenset(f"learners.{m}.{k}" for m, net in enumerate(learners) for k in net.fixed_keys)
        self.shift = self.valve = self.policy = None

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z = torch.cat([net(x) for net in self.learners], 1)
        logits = self.classifier(z)
        return (z, logits) if return_features else logits


class Datastore(nn.Module):
    """kNN-Per's datastore: ``keys`` [capacity, d] (features of local training samples),
    ``labels`` [capacity, C] (one-hot) and ``valid`` [capacity] (1 for a filled row); all zero,
    so unused, in a model that has none (the global model)."""

    def __init__(self, capacity: int, d: int, num_classes: int):
        super().__init__()
        self.register_buffer("keys", torch.zeros(capacity, d))
        self.register_buffer("labels", torch.zeros(capacity, num_classes))
        self.register_buffer("valid", torch.zeros(capacity))


class KNNNet(SkewNet):
    """kNN-Per's model (Marfoq et al., ICML 2022): the configured model (its ``backbone`` and
    ``classifier``) and a datastore (``knn.*``). With a filled datastore the output is the
    interpolation weight * p_kNN + (1 - weight) * softmax(logits) (``mix='probabilities'``, the
    paper's Eq. 3) or weight * p_kNN + (1 - weight) * logits (``'logits'``, FL-bench's), returned
    as its log (probabilities) or as is (logits); p_kNN(c | x) = sum over the k nearest keys
    (squared L2 distance d_j) of exp(-d_j / (dim scale)) [label_j = c], normalised by the sum of
    the weights plus 1e-9 (FL-bench's ``get_knn_logits``). With an empty one: the model's logits."""

    def __init__(self, model: SkewNet, capacity: int, k: int, weight: float, scale: float, mix: str):
        nn.Module.__init__(self)
        self.backbone, self.classifier, self.feature_dim = model.backbone, model.classifier, model.feature_dim
        self.shift, self.valve, self.policy = model.shift, model.valve, model.policy
        self.fixed_keys = model.fixed_keys
        self.knn = Datastore(capacity, model.feature_dim, model.classifier.out_features)
        self.k, self.weight, self.scale, self.mix = min(k, capacity), weight, scale, mix

    def forward(self, x: torch.Tensor, return_features: bool = False):
        z, logits = SkewNet.forward(self, x, True)
        store = self.knn
        d2 = (z.pow(2).sum(1, keepdim=True) - 2 * z @ store.keys.T + store.keys.pow(2).sum(1)).clamp_min(0)
        d2 = d2 + (1 - store.valid) * 1e30  # empty rows never among the nearest
        near, idx = torch.topk(-d2, self.k, dim=1)
        sim = torch.exp(near / (z.shape[1] * self.scale)) * store.valid[idx]  # (near = -d2)
        p_knn = (sim[..., None] * store.labels[idx]).sum(1) / (sim.sum(1, keepdim=True) + 1e-9)
        if self.mix == "probabilities":
            mixed = torch.log(self.weight * p_knn + (1 - self.weight) * torch.softmax(logits, 1) + 1e-12)
        else:
            mixed = self.weight * p_knn + (1 - self.weight) * logits
        on = (store.valid.sum() > 0).to(logits.dtype)  # (no branch: vmap-able)
        out = on * mixed + (1 - on) * logits
        return (z, out) if return_features else out


class SimplexLinear(nn.Module):
    """Floco's classifier (Grinwald et al., NeurIPS 2024; FL-bench's ``SimplexLinear``): M endpoint
    weight matrices (``endpoints`` [M, C, d]) and one bias; the weight is sum_m alpha_m W_m for a
    point alpha of the simplex spanned by the endpoints. In training, each forward pass draws its
    alpha from the per-client stream (:class:`StreamUniform`, 2M + 1 numbers): uniformly on the
    simplex (normalised exponentials) while ``projected`` is 0, else center + U(0, radius) s with s
    the L1-normalised U(-1, 1)^M (FL-bench's ``_sample_L1_ball``). In evaluation alpha is ``center``
    (the simplex's centre, or the client's projected point)."""

    def __init__(self, endpoints: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        m = endpoints.shape[0]
        self.endpoints = nn.Parameter(endpoints)
        self.bias = nn.Parameter(bias)
        self.out_features = endpoints.shape[1]
        self.register_buffer("center", torch.full((m,), 1.0 / m))
        self.register_buffer("radius", torch.zeros(()))
        self.register_buffer("projected", torch.zeros(()))
        self.draws = StreamUniform()

    def alpha(self, z: torch.Tensor) -> torch.Tensor:
        m = len(self.center)
        u = self.draws(z.new_empty(z.shape[0], 2 * m + 1))
        if u is None:
            return self.center
        u = u[0]
        e = -torch.log1p(-u[:m])  # Exp(1)
        on_simplex = e / e.sum()
        v = 2 * u[m:2 * m] - 1
        ball = self.center + u[2 * m] * self.radius * v / v.abs().sum()
        return self.projected * ball + (1 - self.projected) * on_simplex  # (no branch: vmap-able)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        weight = torch.einsum("m,mcd->cd", self.alpha(z), self.endpoints)
        return F.linear(z, weight, self.bias)


def with_projection_head(model: SkewNet, out_dim: int, num_classes: int, bias: bool = True) -> SkewNet:
    """MOON's architecture: backbone -> projection head (Linear d->d, ReLU, Linear d->out_dim) ->
    classifier. The features z are the projection's output."""
    d = model.feature_dim
    body = nn.Sequential(model.backbone, nn.Linear(d, d), nn.ReLU(), nn.Linear(d, out_dim))
    return SkewNet(body, out_dim, num_classes, bias)
