"""fedfed: FedFed (Yang et al., NeurIPS 2023, "FedFed: Feature Distillation against Data Heterogeneity in Federated
Learning"; official code visitworld123/FedFed, read with FL-bench's ``src/{server,client}/fedfed.py``). (Family
``distillation``; the class's docstring has the details.)"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    builtin,
    check_size,
    model_part,
    strip_prefix,
    weighted_mean,
)
from fedskew.streams import numpy_rng, seeded_torch, torch_seed


class FedFedOptions(FedAvgOptions):
    search = {"distill_rounds": [5, 15]}  # the bench's search space (fedskew bench)
    distill_rounds: int = Field(
        15,
        ge=1,
        description="feature-distillation rounds, the first of the run, in which the "
        "selected clients also train the VAE (official VAE_comm_round 15)",
    )
    vae_epochs: int = Field(1, ge=1, le=1000, description="local VAE epochs per distillation round (VAE_local_epoch 1)")
    vae_width: int = Field(32, ge=2, le=4096, description="channels d of the VAE (VAE_d 32); its latent has d H W / 16 "
                                                          "units (2,048 on 32 x 32 images, VAE_z)")
    vae_lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the VAE and its classifier (official 1e-3)")
    vae_weight_decay: float = Field(1e-6, ge=0, description="AdamW weight decay (official 1e-6)")
    vae_batch_size: int = Field(32, ge=2, description="batch size of the distillation steps (the official loaders' 32)")
    mixup_alpha: float = Field(2.0, ge=0, description="Beta(alpha, alpha) of the classifier's mixup epoch (VAE_alpha "
                                                      "2.0; 0: no mixup)")
    rec_weight: float = Field(5.0, ge=0, description="weight of the reconstruction MSE (VAE_re 5.0)")
    ce_weight: float = Field(2.0, ge=0, description="weight of the cross-entropy on the noised performance-sensitive "
                                                    "features (VAE_ce 2.0)")
    kl_weight: float = Field(0.005, ge=0, description="weight of the KL term (VAE_kl 0.005)")
    x_ce_weight: float = Field(0.4, ge=0, description="weight of the cross-entropy on the raw inputs (VAE_x_ce 0.4)")
    curriculum: bool = Field(True, description="the official VAE_curriculum: the reconstruction weight times 10 in "
                                               "local epochs 1-9 and times 5 in 10-19 (with one local epoch a round: "
                                               "always times 10); false: FL-bench's constant weight")
    adaptive: bool = Field(True, description="the official VAE_adaptive: a client with few samples (< 0.2 of the mean) "
                                             "weighs reconstruction x5 and KL x0.5; one whose largest class exceeds "
                                             "0.7 of its data weighs the other terms x5 and skips the VAE-only epoch")
    noise: Literal["gaussian", "laplace"] = Field("gaussian", description="the protecting noise (noise_type)")
    noise_std1: float = Field(0.15, ge=0, description="scale of the first noised copy (VAE_std1 0.15)")
    noise_std2: float = Field(0.25, ge=0, description="scale of the second noised copy (VAE_std2 0.25)")


class ResBlock(torch.nn.Module):
    """x + conv1x1(lrelu(bn(conv3x3(lrelu(x))))) (the official ``ResBlock(d, d, bn=True)``)."""

    def __init__(self, d: int):
        super().__init__()
        self.convs = torch.nn.Sequential(torch.nn.LeakyReLU(), torch.nn.Conv2d(d, d, 3, 1, 1), torch.nn.BatchNorm2d(d),
                                         torch.nn.LeakyReLU(), torch.nn.Conv2d(d, d, 1, 1, 0))

    def forward(self, x):
        return x + self.convs(x)


class FedFedVAE(torch.nn.Module):
    """The official FedFed VAE (``FL_CVAE_cifar`` without its classifier) for [C, H, W] inputs, H and
    W multiples of 4: x -> conv/2 -> BN, ReLU, conv/2, BN, ReLU, 2 residual blocks -> mu, log var
    (linear, d H W / 16 units) -> z -> linear -> 2 residual blocks, transposed conv x2, BN,
    LeakyReLU, tanh, transposed conv x2, BN, sigmoid: the performance-robust part x_r of x."""

    def __init__(self, shape: tuple[int, int, int], d: int):
        super().__init__()
        c, h, w = shape
        self.grid = (d, h // 4, w // 4)
        bn = torch.nn.BatchNorm2d
        self.encoder_former = torch.nn.Conv2d(c, d // 2, 4, 2, 1, bias=False)
        self.encoder = torch.nn.Sequential(bn(d // 2), torch.nn.ReLU(), torch.nn.Conv2d(d // 2, d, 4, 2, 1, bias=False),
                                           bn(d), torch.nn.ReLU(), ResBlock(d), bn(d), ResBlock(d))
        self.decoder = torch.nn.Sequential(ResBlock(d), bn(d), ResBlock(d), bn(d),
                                           torch.nn.ConvTranspose2d(d, d // 2, 4, 2, 1, bias=False), bn(d // 2),
                                           torch.nn.LeakyReLU())
        self.decoder_last = torch.nn.ConvTranspose2d(d // 2, c, 4, 2, 1, bias=False)
        self.xi_bn = bn(c)
        units = d * (h // 4) * (w // 4)
        self.fc11, self.fc12, self.fc21 = (torch.nn.Linear(units, units) for _ in range(3))

    def forward(self, x: torch.Tensor, eps: torch.Tensor | None = None):
        """(x_r, mu, log var); ``eps`` ~ N(0, I) draws the latent mu + eps exp(log var / 2) (None: mu)."""
        h = self.encoder(self.encoder_former(x)).flatten(1)
        mu, logvar = self.fc11(h), self.fc12(h)
        z = mu if eps is None else mu + eps * torch.exp(0.5 * logvar)
        xi = torch.tanh(self.decoder(self.fc21(z).view(-1, *self.grid)))
        return torch.sigmoid(self.xi_bn(self.decoder_last(xi))), mu, logvar


def vae_kl(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """The official KL term: -1/2 sum(1 + log var - mu^2 - var) / (b * 3 * units)."""
    return -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / (mu.shape[0] * 3 * mu.shape[1])


def protect(x_s: torch.Tensor, std: float, kind: str, gen: torch.Generator) -> torch.Tensor:
    """x_s + n, n ~ N(0, std^2) or Laplace(0, std) per element (the shared, noised features)."""
    if kind == "gaussian":
        return x_s + std * torch.randn(x_s.shape, generator=gen, device=x_s.device, dtype=x_s.dtype)
    u = torch.rand(x_s.shape, generator=gen, device=x_s.device, dtype=x_s.dtype) - 0.5
    return x_s - std * torch.sign(u) * torch.log1p(-2 * u.abs())


def balanced_draw(pool_y: torch.Tensor, n: int, rng: np.random.Generator) -> np.ndarray:
    """n pool indices, n // C' from each of the C' classes the pool holds (without replacement where
    the class has enough), the remainder uniformly (the official ``sample_iid_data_from_share_dataset``),
    in a random order."""
    y = pool_y.cpu().numpy()
    classes = np.unique(y)
    each = n // len(classes)
    picks = [rng.choice(np.flatnonzero(y == c), each, replace=each > int((y == c).sum())) for c in classes]
    picks.append(rng.choice(len(y), n - each * len(classes), replace=False))
    return rng.permutation(np.concatenate(picks))


VAE, CLS, POOL = "fedfed.vae.", "fedfed.cls.", "fedfed.pool."


PAIR_X, PAIR_Y, SHARED = "fedfed.pair.x", "fedfed.pair.y", "fedfed.shared"


class FedFedAdamW(torch.optim.Optimizer):
    """The AdamW of FedFed's official client (``optim/AdamW.py``): Adam's moments m, v, then
    p <- p - s (wd p + m / (sqrt(v) + eps)) with s = lr sqrt(1 - beta2^t) / (1 - beta1^t). It differs
    from torch.optim.AdamW (decay lr wd p, eps added after the bias correction) by 4.4e-3 relative
    after one distillation round (measured), so the official form is the one used."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                st["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                st["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                size = group["lr"] * math.sqrt(1 - beta2 ** st["step"]) / (1 - beta1 ** st["step"])
                p.add_(torch.mul(p, group["weight_decay"]).addcdiv_(st["m"], st["v"].sqrt().add_(group["eps"])),
                       alpha=-size)


@builtin
class FedFed(Method):
    """FedFed (Yang et al., NeurIPS 2023, "FedFed: Feature Distillation against Data Heterogeneity in
    Federated Learning"; official code visitworld123/FedFed, read with FL-bench's
    ``src/{server,client}/fedfed.py``).

    Feature distillation (Algorithm 1, the first ``distill_rounds`` rounds): besides its ordinary local training, a
    selected client trains the global VAE G and a classifier f of the model's architecture (in ``after_training``,
    AdamW; apart from the model) on its data for ``vae_epochs`` epochs of three passes, as the official
    ``train_vae_model``: (1) f alone on mixup batches; (2) G alone on rec MSE(G(x), x) + kl KL; (3) both on Eq. (8)'s
    objective in the official form

        rec MSE(x_r, x) + ce CE(f([x_s + n_1; x_s + n_2]), [y; y]) + kl KL + x_ce CE(f(x), y),

    x_r = G(x) the performance-robust part, x_s = x - x_r the performance-sensitive part, n_1, n_2
    the protecting noise (std 0.15, 0.25). The server averages G and f by n_k. Then (the first round
    a client takes part after them) it computes x_s + n_1 and x_s + n_2 of all its data with the final
    G in eval mode and uploads them once (``after_training``); the server pools them. From then on
    every round's local training of a client joins each batch of its own b samples with b samples of
    each noised pool, drawn class-balanced (n_k per pool per round, ``download``, the official
    ``sample_iid_data_from_share_dataset``; ``paired_samples``): plain cross-entropy over the 3b.
    Communication counts G and f in the distillation rounds, the one upload of the shared
    features and the per-round shared samples (2 n_k of them).

    Differences from the official code (docs/methods.md): the distillation rounds are the run's
    first rounds, the model training as FedAvg meanwhile (official: 15 extra rounds before the
    run's); the VAE-only pass trains on the client's batches (FL-bench) instead of mosaics of four
    16 x 16 crops (which presume 32 x 32 images); each sample draws its own noise (official: one
    draw per batch, broadcast); AdamW's moments restart every round (official: kept per client); f
    starts from the initial global model and its BatchNorm statistics are not updated; the server
    samples each client's shared samples once per round (official: the client, each epoch, from its
    copy of the whole pool)."""
    family = "distillation"

    name = "fedfed"
    Options = FedFedOptions
    source = Source(
        authors="Yang et al.",
        title="FedFed: Feature Distillation against Data Heterogeneity in Federated Learning",
        venue="NeurIPS",
        arxiv="2310.05077", year=2023,
        implements="Eq. 8 (the VAE's feature distillation objective) and the shared noised features",
        code="visitworld123/FedFed")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None:
            shape = tuple(info.public_samples[0].shape[1:]) if info.public_samples is not None else ()
            if len(shape) != 3 or shape[1] % 4 or shape[2] % 4:
                raise ValueError(f"method fedfed's VAE needs images [C, H, W] with H and W multiples of 4, not inputs "
                                 f"of shape {list(shape)}")
            self.shape = shape
            with torch.device("meta"):  # counted before anything is allocated
                floats = sum(p.numel() for p in FedFedVAE(shape, self.opt.vae_width).parameters())
            check_size("fedfed", f"VAE (method.vae_width = {self.opt.vae_width})", floats)

    def _vae(self, state: State | None = None) -> FedFedVAE:
        """A fresh VAE, or one holding ``state`` (its float tensors; the batch counters start at zero):
        then built without drawing an initialisation that ``state`` overwrites (7.4M floats on
        Fashion-MNIST, twice per client and round)."""
        if state is None:
            return FedFedVAE(self.shape, self.opt.vae_width)
        with torch.device("meta"):
            vae = FedFedVAE(self.shape, self.opt.vae_width)
        vae.to_empty(device=next(iter(state.values())).device)
        vae.load_state_dict(
            {**{k: torch.zeros_like(v) for k, v in vae.state_dict().items() if k not in state}, **state}
        )
        return vae

    def server_init(self, global_state, info):
        device = next(iter(global_state.values())).device
        with seeded_torch(info.seed, "fedfed_vae"):
            vae = self._vae()
        return {**add_prefix({k: v.to(device) for k, v in vae.state_dict().items() if v.is_floating_point()}, VAE),
                **add_prefix(global_state, CLS), "fedfed.round": torch.zeros((), device=device),
                SHARED: torch.zeros(info.num_clients, device=device),
                POOL + "x1": torch.zeros(0, *self.shape, device=device),
                POOL + "x2": torch.zeros(0, *self.shape, device=device),
                POOL + "y": torch.zeros(0, dtype=torch.long, device=device)}

    def client_init(self, client_id, global_state, info):
        return {SHARED: torch.zeros((), device=next(iter(global_state.values())).device)}

    def broadcast(self, global_state, server_state):
        """The model; in the distillation rounds G and f; then G until every client has shared."""
        payload = as_model_part(global_state)
        if any(k.startswith(CLS) for k in server_state):
            payload.update({k: v for k, v in server_state.items() if k.startswith((VAE, CLS)) or k == "fedfed.round"})
        elif any(k.startswith(VAE) for k in server_state):
            payload.update({k: v for k, v in server_state.items() if k.startswith(VAE)})
        return payload

    def download(self, server_state, client_id, round_idx):
        """The client's shared samples of the round: n_k from each noised pool, class-balanced."""
        pool_y = server_state[POOL + "y"]
        if not len(pool_y):
            return {}
        n = int(self.info.class_counts[client_id].sum())
        rng = numpy_rng(self.info.seed, "fedfed_pairs", round_idx, client_id)
        i1, i2 = (torch.from_numpy(balanced_draw(pool_y, n, rng)).to(pool_y.device) for _ in range(2))
        return {PAIR_X: torch.stack([server_state[POOL + "x1"][i1], server_state[POOL + "x2"][i2]], 1),
                PAIR_Y: torch.stack([pool_y[i1], pool_y[i2]], 1)}

    def paired_samples(self, client_state):
        if PAIR_X not in client_state:
            return None, client_state
        return (client_state[PAIR_X], client_state[PAIR_Y]), \
            {k: v for k, v in client_state.items() if k not in (PAIR_X, PAIR_Y)}

    def loss_weights(self, client_id: int) -> tuple[float, float, float, float, bool]:
        """(rec, ce, kl, x_ce, VAE-only pass) of the client (``adaptive``: the official client
        properties from its sample count and largest class)."""
        o = self.opt
        w = (o.rec_weight, o.ce_weight, o.kl_weight, o.x_ce_weight, True)
        if o.adaptive:
            counts = self.info.class_counts
            n, mean = float(counts[client_id].sum()), float(counts.sum()) / counts.shape[0]
            if n < 0.2 * mean:
                return 5 * o.rec_weight, o.ce_weight, 0.5 * o.kl_weight, o.x_ce_weight, True
            if float(counts[client_id].max()) > 0.7 * n:
                return o.rec_weight, 5 * o.ce_weight, 5 * o.kl_weight, 5 * o.x_ce_weight, False
        return w

    def distill(self, vae: FedFedVAE, cls: State, x: torch.Tensor, y: torch.Tensor, client_id: int, round_idx: int
                ) -> tuple[State, State]:
        """One distillation round of a client (the official ``train_vae_model``): ``vae_epochs`` x
        (mixup epoch of f, VAE-only epoch, joint epoch), AdamW over G and f; the trained G (float
        state) and f."""
        o, call = self.opt, self.info.model_call
        vae.to(x.device).train()
        cls = {k: v.detach().clone().requires_grad_(k in self.info.param_names) for k, v in cls.items()}
        trained = [v for v in cls.values() if v.requires_grad]
        opt = FedFedAdamW([*vae.parameters(), *trained], lr=o.vae_lr, weight_decay=o.vae_weight_decay)
        rng = numpy_rng(self.info.seed, "fedfed_distill", round_idx, client_id)
        gen = torch.Generator(x.device).manual_seed(torch_seed(self.info.seed, "fedfed_noise", round_idx, client_id))
        rec, ce, kl, x_ce, vae_pass = self.loss_weights(client_id)
        b = o.vae_batch_size

        def batches():
            order = torch.from_numpy(rng.permutation(len(y))).to(x.device)
            return [order[i:i + b] for i in range(0, len(y), b) if len(order[i:i + b]) > 1]

        def step(loss):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for epoch in range(1, o.vae_epochs + 1):
            re = rec * (10 if epoch < 10 else 5 if epoch < 20 else 1) if o.curriculum else rec
            for rows in batches():  # (1) the classifier on mixup batches
                lam = float(rng.beta(o.mixup_alpha, o.mixup_alpha)) if o.mixup_alpha > 0 else 1.0
                mate = torch.from_numpy(rng.permutation(len(rows))).to(x.device)
                logits = call(cls, lam * x[rows] + (1 - lam) * x[rows][mate], True)[1]
                step(lam * F.cross_entropy(logits, y[rows]) + (1 - lam) * F.cross_entropy(logits, y[rows][mate]))
            if vae_pass:  # (2) the VAE alone
                for rows in batches():
                    eps = torch.randn(len(rows), vae.fc11.out_features, generator=gen, device=x.device)
                    x_r, mu, logvar = vae(x[rows], eps)
                    step(re * F.mse_loss(x_r, x[rows]) + o.kl_weight * vae_kl(mu, logvar))
            for rows in batches():  # (3) both, Eq. (8)
                eps = torch.randn(len(rows), vae.fc11.out_features, generator=gen, device=x.device)
                xb, yb = x[rows], y[rows]
                x_r, mu, logvar = vae(xb, eps)
                x_s = xb - x_r
                noised = torch.cat([protect(x_s, o.noise_std1, o.noise, gen), protect(x_s, o.noise_std2, o.noise, gen)])
                logits = call(cls, torch.cat([noised, xb]), True)[1]
                step(re * F.mse_loss(x_r, xb) + ce * F.cross_entropy(logits[:2 * len(rows)], yb.repeat(2))
                     + kl * vae_kl(mu, logvar) + x_ce * F.cross_entropy(logits[2 * len(rows):], yb))
        return ({k: v.detach() for k, v in vae.state_dict().items() if v.is_floating_point()},
                {k: v.detach() for k, v in cls.items()})

    @torch.no_grad()
    def share(self, vae: FedFedVAE, x: torch.Tensor, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x_s + n_1 and x_s + n_2 of every sample, G in eval mode (x_r from mu)."""
        vae.to(x.device).eval()
        gen = torch.Generator(x.device).manual_seed(torch_seed(self.info.seed, "fedfed_share", client_id))
        x_s = torch.cat([x[i:i + 1024] - vae(x[i:i + 1024])[0] for i in range(0, len(x), 1024)])
        return protect(x_s, self.opt.noise_std1, self.opt.noise, gen), protect(
            x_s, self.opt.noise_std2, self.opt.noise, gen
        )

    def after_training(self, trained, payload, client_state, report):
        """The model; in a distillation round also the client's trained G and f; the first round
        after, once, its noised performance-sensitive features."""
        upload = as_model_part(trained)
        if any(k.startswith(CLS) for k in payload):
            x, y = report.local_data()
            round_idx = int(payload["fedfed.round"])
            with torch.random.fork_rng(devices=[]):  # dropout in f: the client's stream
                torch.manual_seed(torch_seed(self.info.seed, "fedfed_dropout", round_idx, report.client_id))
                vae, cls = self.distill(self._vae(strip_prefix(payload, VAE)), strip_prefix(payload, CLS), x, y,
                                        report.client_id, round_idx)
            return {**upload, **add_prefix(vae, VAE), **add_prefix(cls, CLS)}, client_state
        if any(k.startswith(VAE) for k in payload) and not bool(client_state[SHARED]):
            x, y = report.local_data()
            x1, x2 = self.share(self._vae(strip_prefix(payload, VAE)), x, report.client_id)
            return {**upload, "fedfed.x1": x1, "fedfed.x2": x2, "fedfed.y": y}, \
                {**client_state, SHARED: torch.ones_like(client_state[SHARED])}
        return upload, client_state

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        server = dict(server_state)
        distilled = [i for i, u in enumerate(uploads) if any(k.startswith(VAE) for k in u)]
        if distilled:  # G and f: weighted by n_k (the official _aggregate_sampled_client_vae)
            n = torch.tensor([float(reports[i].num_samples) for i in distilled], dtype=torch.float64)
            for prefix in (VAE, CLS):
                server.update(
                    add_prefix(
                        weighted_mean([strip_prefix(uploads[i], prefix) for i in distilled], n / n.sum()), prefix
                    )
                )
        sharing = [(u, r) for u, r in zip(uploads, reports) if "fedfed.x1" in u]
        if sharing:
            for key in ("x1", "x2", "y"):
                server[POOL + key] = torch.cat([server[POOL + key], *(u["fedfed." + key] for u, _ in sharing)])
            server[SHARED] = server[SHARED].clone()
            server[SHARED][[r.client_id for _, r in sharing]] = 1
        server["fedfed.round"] = server["fedfed.round"] + 1
        if int(server["fedfed.round"]) >= self.opt.distill_rounds:  # f is done; G once every client shared
            server = {k: v for k, v in server.items()
                      if not k.startswith(CLS) and not (k.startswith(VAE) and bool(server[SHARED].all()))}
        return new, server
