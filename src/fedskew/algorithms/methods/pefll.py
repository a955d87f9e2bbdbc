"""pefll: PeFLL (Scott, Zakerinia and Lampert, ICLR 2024): an embedding network turns a client's data into a
descriptor v, a hypernetwork turns v into the client's model, and both learn from the clients' local updates; a
new client gets its model from its data alone. (Family ``hypernetwork``; the class's docstring has the details.)"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import Method, Source, StrictOptions, builtin, check_size
from fedskew.algorithms.hypernetwork import hyper_floats, hyper_forward, hyper_layers
from fedskew.algorithms.tensors import adam_step
from fedskew.streams import seeded_torch, torch_seed

# the server's networks (eta_v: embedding, eta_h: hypernetwork), Adam's moments and step, the frozen (m, s)
EMBED, HYPER, MOM1, MOM2, STEP, STAT, SHAPE = "pe.v.", "pe.h.", "pe.m1.", "pe.m2.", "pe.step", "pe.stat", "pe.shape."
# a client's round: the generated model, the descriptor batch, the (m, s) it used; its upload
SENT, BATCH_X, BATCH_Y, USED = "pe.w.", "pe.bx", "pe.by", "pe.used"
DELTA, DESCRIPTOR, EMBED_GRAD, RAW_STAT = "pe.delta.", "pe.desc", "pe.gv.", "pe.raw"
SIDE = 32  # the embedding CNN's input side: smaller images are resized to it (FL-bench's EmbedNetwork)


class PeFLLOptions(StrictOptions):
    search = {"server_lr": [1e-4, 2e-4, 5e-4]}  # the bench's search space (fedskew bench)
    embed_dim: int | None = Field(None, ge=1, le=1 << 14, description=
        "size of the descriptor v; None: 1 + num_clients / 4 (the code's --embed-dim -1)")
    embed_model: Literal["cnn", "labels"] = Field(
        "cnn", description="the embedding network: cnn (the code's CNNEmbed, a LeNet on the image with the one-hot "
                           "label as extra channels) or labels (its MLPEmbed: a linear map of the one-hot label, so "
                           "v is a function of the client's label histogram)")
    embed_batch: int = Field(32, ge=1, le=1 << 16, description=
        "samples of the one shuffled batch a training client describes itself with (the code's batch 32, "
        "embed_batches 1); at most the smallest client's training samples. The final pass describes every "
        "client with all its training samples, as the code's evaluation does")
    hidden: int = Field(100, ge=1, le=1 << 14, description="width of the hypernetwork's MLP (--hyper-hid 100)")
    n_hidden: int = Field(3, ge=0, le=64, description="hidden layers of that MLP after its first (--n-hidden 3)")
    server_lr: float = Field(2e-4, gt=0, description="Adam's learning rate on both networks (--lr 2e-4)")
    clip: float = Field(50.0, gt=0, description="norm clip of the round's mean gradient over both networks (50)")
    inner_steps: int | None = Field(50, ge=1, le=1 << 20, description=
        "local SGD steps per round (the code's --inner-steps 50); None: the run's local_epochs")
    descriptor_norm: Literal["first", "per_vector"] = Field(
        "first", description="first: v standardised by the mean and std of the first descriptor the server "
                             "receives, then frozen (the authors' code); per_vector: each v by its own mean and "
                             "std, differentiated through (FL-bench)")


def embed_layers(opt: PeFLLOptions, channels: int, side: tuple[int, int], num_classes: int, dim: int) -> dict:
    """eta_v as PyTorch initialises it: CNNEmbed (Conv(C + K, 16, 5), Conv(16, 32, 5), each ReLU and max-pool 2,
    then Linear 120, 84, dim with ReLU between) or the label embedding Linear(K, dim)."""
    if opt.embed_model == "labels":
        return {"fc": nn.Linear(num_classes, dim)}
    h, w = (max(s, SIDE) for s in side)
    flat = 32 * (((h - 4) // 2 - 4) // 2) * (((w - 4) // 2 - 4) // 2)
    return {"conv1": nn.Conv2d(channels + num_classes, 16, 5), "conv2": nn.Conv2d(16, 32, 5),
            "fc1": nn.Linear(flat, 120), "fc2": nn.Linear(120, 84), "fc3": nn.Linear(84, dim)}


def embed(eta: dict, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """phi(x, y; eta_v) for each sample [n, dim]: the image (resized to 32 x 32 when smaller, as FL-bench)
    with the one-hot label broadcast over it as K more channels, through the CNN; or the label alone."""
    onehot = F.one_hot(y, num_classes).to(x.dtype)
    if "fc" in eta:
        return F.linear(onehot, eta["fc.weight"], eta["fc.bias"])
    if x.shape[-2] < SIDE or x.shape[-1] < SIDE:
        x = F.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    x = torch.cat([x, onehot[:, :, None, None].expand(-1, -1, *x.shape[-2:])], 1)
    for conv in ("conv1", "conv2"):
        x = F.max_pool2d(F.relu(F.conv2d(x, eta[conv + ".weight"], eta[conv + ".bias"])), 2)
    x = F.relu(F.linear(x.flatten(1), eta["fc1.weight"], eta["fc1.bias"]))
    x = F.relu(F.linear(x, eta["fc2.weight"], eta["fc2.bias"]))
    return F.linear(x, eta["fc3.weight"], eta["fc3.bias"])


def descriptor(eta: dict, x, y, num_classes: int, stat: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, raw (m, s)): the mean embedding of the samples, standardised by ``stat`` = (m, s) (frozen: no
    gradient) or, with None, by its own mean and (unbiased) std, differentiated through. The code divides the
    sum by 2 per batch and FL-bench by the samples; either way the standardisation cancels the divisor."""
    raw = embed(eta, x, y, num_classes).mean(0)
    own = torch.stack([raw.mean(), raw.std()])
    m, s = (own[0], own[1]) if stat is None else (stat[0], stat[1])
    return (raw - m) / s, own.detach()


def descriptor_batch(seed: int, round_idx: int, client_id: int, n: int, size: int) -> torch.Tensor:
    """Positions of the shuffled batch a client describes itself with in a round (stream ``pefll_batch``)."""
    gen = torch.Generator().manual_seed(torch_seed(seed, "pefll_batch", round_idx, client_id))
    return torch.randperm(n, generator=gen)[:size]


def clip_scale(grads, clip: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, clip / (||g|| + 1e-6)) over all the tensors."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return torch.clamp(clip / (norm + 1e-6), max=1.0)


@builtin
class PeFLL(Method):
    """PeFLL (Scott, Zakerinia and Lampert, ICLR 2024) as the authors' code runs it (jonnyascott/PeFLL
    ``train.py``, ``models.py`` at 18659a1). A selected client describes itself by
    v = (mean_{(x, y) in S} phi(x, y; eta_v) - m) / s over one shuffled batch S of its training data (32), gets
    theta = h(v; eta_h) and trains it (50 SGD steps, lr 2e-3, momentum 0.9, weight decay 5e-5, gradient clip
    50: the method's ``run_defaults`` where the config leaves them unset). The gradient of both networks is
    J^T (theta - theta~), J = d theta / d (eta_v, eta_h) through v; the server averages it over the round's
    clients (uniformly), clips its joint norm to 50 and takes one Adam step (lr 2e-4). (m, s) are the mean
    and std of the first descriptor the server receives, frozen for the run (the code's); in the first
    round every client standardises by its own, as the code's first client does (the code's later
    clients of that step use the first one's).

    Where the computation runs: the paper keeps h on the server and exchanges v, theta and dL/dv; fedskew's
    protocol has one message each way per round, so, as FL-bench does, the client receives both networks
    (``Down``), generates theta itself and returns theta - theta~ with v and its own eta_v gradient, and the
    server back-propagates theta - theta~ through h. The numbers are the same; the download is not.

    Evaluation: the personalised model is the trained theta~; ``personal/acc_before`` is the generated
    theta, the model the code evaluates (it describes the client with all its training data, as the final
    pass here does), and ``unseen/final_acc_before`` the same for clients that never trained (the paper's
    new clients). The code's evaluation also zeroes the logits of classes absent from a client's training
    data (``--mask-absent``); fedskew scores every method alike and does not. No global model.

    Down: eta_v, eta_h (about ``hidden`` + 1 times the model) and (m, s). Up: theta - theta~ (|theta|),
    v, the eta_v gradient and the client's own (m, s). The model must not have BatchNorm statistics."""
    family = "hypernetwork"

    name = "pefll"
    Options = PeFLLOptions
    source = Source(
        authors="Scott, Zakerinia, Lampert",
        title="PeFLL: Personalized Federated Learning by Learning to Learn",
        venue="ICLR",
        year=2024,
        arxiv="2306.05515",
        implements="the embedding and hypernetwork, their update from the clients' local training, and the "
                   "descriptor-only model of a new client",
        code="jonnyascott/PeFLL (train.py, models.py at 18659a1)")
    # the code's inner optimiser (--inner-lr 2e-3, momentum 0.9, --inner-wd 5e-5, clip 50, batch 32)
    run_defaults = {"lr": 2e-3, "momentum": 0.9, "weight_decay": 5e-5, "grad_clip": 50.0, "batch_size": 32}
    has_global_model = False
    fedavg_weighted = False  # the server takes a gradient step (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is None:
            return
        if any(n.endswith("running_mean") for n in info.norm_names):
            raise ValueError("method pefll generates a model's parameters, not BatchNorm statistics; use a model "
                             "without BatchNorm (mlp, lenet, simplecnn, tfcnn, ...)")
        sample = info.public_samples[0] if info.public_samples is not None else None
        if self.opt.embed_model == "cnn" and sample is not None and sample.dim() != 4:
            raise ValueError(f"method pefll's embed_model = cnn reads images, but the data's samples have shape "
                             f"{tuple(sample.shape[1:])}; use method.embed_model=labels")
        dim, h = self.dim, self.opt.hidden
        check_size("pefll", f"hypernetwork (method.hidden = {h}, method.embed_dim = {dim})",
                   3 * hyper_floats(dim, h, self.opt.n_hidden, info.param_numel))
        sizes = info.class_counts.sum(1)
        self.batch = int(min(self.opt.embed_batch, max(1, int(sizes[sizes > 0].min()))))

    @property
    def dim(self) -> int:
        return self.opt.embed_dim or int(1 + self.info.num_clients / 4)

    def local_steps(self, round_idx, total_steps, steps_per_epoch):
        return total_steps if self.opt.inner_steps is None else self.opt.inner_steps

    def server_init(self, global_state, info):
        """eta_v and eta_h from the experiment's seed (stream ``pefll``), PyTorch's default initialisations;
        Adam's moments zero; (m, s) unset (NaN) until the first upload."""
        x = info.public_samples[0]
        shapes = {n: global_state[n].shape for n in info.param_names}
        with seeded_torch(info.seed, "pefll"):
            layers = {EMBED: embed_layers(self.opt, x.shape[1], tuple(x.shape[-2:]), info.num_classes, self.dim),
                      HYPER: hyper_layers(self.dim, self.opt.hidden, self.opt.n_hidden, shapes)}
        device = next(iter(global_state.values())).device
        nets = {prefix + f"{k}.{n}": t.detach().to(device) for prefix, group in layers.items()
                for k, layer in group.items() for n, t in layer.named_parameters()}
        return {**nets, **{MOM1 + k: torch.zeros_like(v) for k, v in nets.items()},
                **{MOM2 + k: torch.zeros_like(v) for k, v in nets.items()},
                STEP: torch.zeros((), dtype=torch.int64), STAT: torch.full((2,), math.nan, device=device),
                **{SHAPE + n: torch.tensor(list(shape)) for n, shape in shapes.items()}}

    def broadcast(self, global_state, server_state):
        return {k: v for k, v in server_state.items() if k.startswith((EMBED, HYPER, STAT, SHAPE))}

    @staticmethod
    def _nets(state) -> tuple[dict, dict, dict]:
        eta_v = {k[len(EMBED):]: v for k, v in state.items() if k.startswith(EMBED)}
        eta_h = {k[len(HYPER):]: v for k, v in state.items() if k.startswith(HYPER)}
        shapes = {k[len(SHAPE):]: torch.Size(v.tolist()) for k, v in state.items() if k.startswith(SHAPE)}
        return eta_v, eta_h, shapes

    def prepare(self, payload, client_state, data):
        """v from one shuffled batch of the client's training data (all of it in the final pass), theta = h(v)."""
        eta_v, eta_h, shapes = self._nets(payload)
        x, y = data.x, data.y
        training = data.round_idx < self.info.rounds
        if training:
            pos = descriptor_batch(self.info.seed, data.round_idx, data.client_id, len(y), self.batch).to(y.device)
            x, y = x[pos], y[pos]
        stat = payload[STAT]
        with torch.no_grad():
            frozen = self.opt.descriptor_norm == "first"
            if frozen and torch.isnan(stat).any():  # before the server has (m, s): the client's own
                v, stat = descriptor(eta_v, x, y, self.info.num_classes, None)
            else:
                v, _ = descriptor(eta_v, x, y, self.info.num_classes, stat if frozen else None)
            theta = hyper_forward(eta_h, v, shapes, self.opt.n_hidden)
        state = {**client_state, **{SENT + n: t for n, t in theta.items()}}
        if training:
            state.update({BATCH_X: x, BATCH_Y: y, USED: stat})
        return state

    def local_start(self, payload, client_state):
        return {k[len(SENT):]: v for k, v in client_state.items() if k.startswith(SENT)}

    def after_training(self, trained, payload, client_state, report):
        """Up: theta - theta~, v, and the eta_v gradient (d v / d eta_v)^T (d theta / d v)^T (theta - theta~)."""
        kept = {k: v for k, v in client_state.items() if not k.startswith((SENT, BATCH_X, BATCH_Y, USED))}
        delta = {n[len(SENT):]: v - trained[n[len(SENT):]] for n, v in client_state.items() if n.startswith(SENT)}
        upload = {DELTA + n: d for n, d in delta.items()}
        if BATCH_X not in client_state:  # the final pass: nothing goes back
            return upload, kept
        eta_v, eta_h, shapes = self._nets(payload)
        names = list(eta_v)
        with torch.enable_grad():
            leaves = {n: t.detach().requires_grad_(True) for n, t in eta_v.items()}
            frozen = self.opt.descriptor_norm == "first"
            v, raw = descriptor(leaves, client_state[BATCH_X], client_state[BATCH_Y], self.info.num_classes,
                                client_state[USED] if frozen else None)
            theta = hyper_forward(eta_h, v, shapes, self.opt.n_hidden)
            grads = torch.autograd.grad(list(theta.values()), [leaves[n] for n in names],
                                        grad_outputs=[delta[n] for n in theta], allow_unused=True)
        upload.update({EMBED_GRAD + n: torch.zeros_like(eta_v[n]) if g is None else g for n, g in zip(names, grads)})
        upload.update({DESCRIPTOR: v.detach(), RAW_STAT: raw})
        return upload, kept

    def aggregate(self, server_state, global_state, uploads, reports):
        """The round's mean gradient of (eta_v, eta_h) (eta_h's back-propagated here from each v and theta -
        theta~), its joint norm clipped, one Adam step; (m, s) from the round's first client if unset."""
        eta_v, eta_h, shapes = self._nets(server_state)
        hyper = {n: t.detach().requires_grad_(True) for n, t in eta_h.items()}
        names = list(hyper)
        grad = {EMBED + n: sum(u[EMBED_GRAD + n] for u in uploads) / len(uploads) for n in eta_v}
        total = None
        for u in uploads:
            with torch.enable_grad():
                theta = hyper_forward(hyper, u[DESCRIPTOR], shapes, self.opt.n_hidden)
                got = torch.autograd.grad(list(theta.values()), [hyper[n] for n in names],
                                          grad_outputs=[u[DELTA + n] for n in theta], allow_unused=True)
            got = [torch.zeros_like(hyper[n]) if g is None else g for n, g in zip(names, got)]
            total = got if total is None else [a.add_(b) for a, b in zip(total, got)]
        grad.update({HYPER + n: g.div_(len(uploads)) for n, g in zip(names, total)})
        scale = clip_scale(grad.values(), self.opt.clip)
        step = int(server_state[STEP]) + 1
        new = dict(server_state)
        for k, g in grad.items():
            p, m, v = server_state[k].clone(), server_state[MOM1 + k].clone(), server_state[MOM2 + k].clone()
            adam_step(p, g.mul_(scale), m, v, step, self.opt.server_lr)
            new.update({k: p, MOM1 + k: m, MOM2 + k: v})
        new[STEP] = torch.tensor(step)
        if torch.isnan(server_state[STAT]).any() and self.opt.descriptor_norm == "first":
            new[STAT] = uploads[0][RAW_STAT].to(server_state[STAT])
        return global_state, new
