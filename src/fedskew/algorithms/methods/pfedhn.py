"""pfedhn: pFedHN (Shamsian et al., ICML 2021, Algorithm 1) as the authors' code runs it: a selected client
receives theta_k = h(v_k; phi) (``download``), trains it with the run's local SGD, and sends Delta_k = theta_k -
theta~_k; the server steps on phi with torch.optim.SGD semantics (lr, momentum 0.9, weight decay, applied to the
embeddings too) and the gradient grad_phi theta_k^T Delta_k, clipped to norm 50, once per client of the round
(``server_step=per_client``, in the round's order; ``mean``: once with their mean). (Family ``hypernetwork``;
the class's docstring has the details.)"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import Method, Source, StrictOptions, builtin, check_size
from fedskew.algorithms.hypernetwork import hyper_floats, hyper_forward, hyper_layers
from fedskew.streams import seeded_torch

PHI, MOMENTUM, SHAPE, SENT, DELTA = "hn.phi.", "hn.mom.", "hn.shape.", "hn.w.", "hn.delta."


def generate(phi: dict, client_id: int, shapes: dict, n_hidden: int) -> dict:
    """theta_k = h(v_k; phi): the hypernetwork (:func:`~fedskew.algorithms.hypernetwork.hyper_forward`) on
    client k's learned embedding (``phi["embeddings"][client_id]``). Differentiable in ``phi``."""
    return hyper_forward(phi, phi["embeddings"][client_id], shapes, n_hidden)


class PFedHNOptions(StrictOptions):
    search = {"server_lr": [0.003, 0.01, 0.03]}  # the bench's search space (fedskew bench)
    embed_dim: int | None = Field(None, ge=1, le=1 << 14, description=
        "size of the client embeddings v_k; None: 1 + num_clients / 4 (the authors' --embed-dim -1)")
    hidden: int = Field(100, ge=1, le=1 << 14, description="width of the hypernetwork's MLP (--hyper-hid 100)")
    n_hidden: int = Field(3, ge=0, le=64, description="hidden layers of that MLP after its first (--n-hidden 3)")
    server_lr: float = Field(0.01, gt=0, description="the hypernetwork's SGD learning rate (--lr 1e-2)")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="its momentum (the authors' 0.9)")
    server_wd: float = Field(1e-3, ge=0, description="its weight decay (--wd 1e-3)")
    clip: float = Field(50.0, gt=0, description="the hypernetwork gradient's norm clip (the authors' 50)")
    server_step: Literal["per_client", "mean"] = Field("per_client", description=
        "per_client: one SGD step on the hypernetwork per client of the round, in the round's order, each with that "
        "client's gradient at the phi that generated its model (the authors step once per client); mean: one step "
        "with the round's mean gradient")


@builtin
class PFedHN(Method):
    """pFedHN (Shamsian et al., ICML 2021, Algorithm 1) as the authors' code runs it: a selected
    client receives theta_k = h(v_k; phi) (``download``), trains it with the run's local SGD, and
    sends Delta_k = theta_k - theta~_k; the server steps on phi with torch.optim.SGD semantics (lr,
    momentum 0.9, weight decay, applied to the embeddings too) and the gradient grad_phi theta_k^T
    Delta_k, clipped to norm 50, once per client of the round (``server_step=per_client``, in the
    round's order; ``mean``: once with their mean). With one client per round this is the authors'
    loop exactly (their 50 inner steps are the run's E epochs here; their inner lr 5e-3, weight
    decay 5e-5 and gradient clip 50 are the method's ``run_defaults``, used where the config leaves
    lr, weight_decay and grad_clip unset: at the run's lr 0.01 and no clip, one seed in three of the
    README setting diverged); with several, every client's model came from the round's
    first phi, so the later steps use gradients taken there (the authors generate each client's
    model from the phi of the step before). The client's
    personalised model is its trained theta~_k; ``personal/acc_before`` is the generated
    theta_k, the model the paper evaluates. No global model. The hypernetwork's heads are
    ``hidden`` x |theta| weights: about 100 times the model, on the server.

    Down: theta_k (|theta|), up: Delta_k (|theta|). The model must not have BatchNorm statistics
    (the authors' target networks have none; the hypernetwork generates parameters only)."""
    family = "hypernetwork"

    name = "pfedhn"
    Options = PFedHNOptions
    source = Source(
        authors="Shamsian, Navon, Fetaya, Chechik",
        title="Personalized Federated Learning using Hypernetworks",
        venue="ICML",
        year=2021,
        arxiv="2103.04628",
        implements="Algorithm 1",
        code="AvivSham/pFedHN")
    # the authors' inner optimiser (trainer.py: --inner-lr 5e-3, --inner-wd 5e-5, clip_grad_norm_ 50),
    # where the config leaves the run's lr, weight_decay and grad_clip unset
    run_defaults = {"lr": 5e-3, "weight_decay": 5e-5, "grad_clip": 50.0}
    has_global_model = False
    fedavg_weighted = False  # the server takes a gradient step (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None and any(n.endswith("running_mean") for n in info.norm_names):
            raise ValueError("method pfedhn generates a model's parameters, not BatchNorm statistics; use a model "
                             "without BatchNorm (mlp, lenet, simplecnn, tfcnn, ...)")
        if info is not None:  # phi (with its momentum): embeddings, the MLP and one head per model tensor
            e, h = self.opt.embed_dim or int(1 + info.num_clients / 4), self.opt.hidden
            check_size("pfedhn", f"hypernetwork (method.hidden = {h}, method.embed_dim = {e})",
                       2 * (info.num_clients * e + hyper_floats(e, h, self.opt.n_hidden, info.param_numel)))

    @staticmethod
    def _shapes(server_state) -> dict:
        """The target model's parameter shapes, kept in the server state (``download`` sees no model)."""
        return {k[len(SHAPE):]: torch.Size(v.tolist()) for k, v in server_state.items() if k.startswith(SHAPE)}

    def server_init(self, global_state, info):
        """phi from the experiment's seed (stream ``pfedhn``), PyTorch's default initialisations
        (embeddings N(0, 1), linear layers uniform), as the authors' ``CNNHyper``; momentum zero."""
        e = self.opt.embed_dim or int(1 + info.num_clients / 4)
        shapes = {n: global_state[n].shape for n in info.param_names}
        with seeded_torch(info.seed, "pfedhn"):
            layers = {"embeddings": nn.Embedding(info.num_clients, e),
                      **hyper_layers(e, self.opt.hidden, self.opt.n_hidden, shapes)}
        device = next(iter(global_state.values())).device
        phi = {(f"{k}.{n}" if k != "embeddings" else k): t.detach().to(device)
               for k, layer in layers.items() for n, t in layer.named_parameters()}
        return {**{PHI + k: v for k, v in phi.items()}, **{MOMENTUM + k: torch.zeros_like(v) for k, v in phi.items()},
                **{SHAPE + n: torch.tensor(list(shape)) for n, shape in shapes.items()}}

    def broadcast(self, global_state, server_state):
        return {}  # every client gets its own model (download)

    def download(self, server_state, client_id, round_idx):
        phi = {k[len(PHI):]: v for k, v in server_state.items() if k.startswith(PHI)}
        with torch.no_grad():
            theta = generate(phi, client_id, self._shapes(server_state), self.opt.n_hidden)
        return {SENT + n: v for n, v in theta.items()}

    def local_start(self, payload, client_state):
        return {k[len(SENT):]: v for k, v in client_state.items() if k.startswith(SENT)}

    def after_training(self, trained, payload, client_state, report):
        upload = {DELTA + n[len(SENT):]: v - trained[n[len(SENT):]] for n, v in client_state.items()
                  if n.startswith(SENT)}
        return upload, {k: v for k, v in client_state.items() if not k.startswith(SENT)}

    def aggregate(self, server_state, global_state, uploads, reports):
        """SGD steps on phi with the clients' gradients grad_phi theta_k^T Delta_k (taken at the phi
        that generated theta_k), each clipped to norm 50: one per client (``per_client``) or one
        with their mean (``mean``)."""
        names = [k[len(PHI):] for k in server_state if k.startswith(PHI)]
        phi = {n: server_state[PHI + n].detach().requires_grad_(True) for n in names}
        shapes = self._shapes(server_state)

        def gradient(upload, report) -> dict:
            with torch.enable_grad():
                theta = generate(phi, report.client_id, shapes, self.opt.n_hidden)
                got = torch.autograd.grad(list(theta.values()), [phi[n] for n in names],
                                          grad_outputs=[upload[DELTA + n] for n in theta], allow_unused=True)
            return {n: torch.zeros_like(phi[n]) if g is None else g for n, g in zip(names, got)}

        grads = (gradient(u, r) for u, r in zip(uploads, reports))
        if self.opt.server_step == "mean":
            total = next(grads)
            for grad in grads:
                for n in names:
                    total[n].add_(grad[n])
            grads = iter([{n: g.div_(len(uploads)) for n, g in total.items()}])
        # phi's heads are ~100 x |theta| floats: the steps run in place on copies of phi and its momentum,
        # one gradient at a time, each operation the one torch.optim.SGD's formula names (bit-equal to it)
        new = dict(server_state)
        params = {n: server_state[PHI + n].clone() for n in names}
        moms = {n: server_state[MOMENTUM + n].clone() for n in names}
        spare = {n: torch.empty_like(p) for n, p in params.items()}
        for grad in grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grad.values()]))
            scale = torch.clamp(self.opt.clip / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_
            for n in names:
                p, m, tmp = params[n], moms[n], spare[n]
                d = grad[n].mul_(scale).add_(torch.mul(p, self.opt.server_wd, out=tmp))  # g + wd p
                m.mul_(self.opt.server_momentum).add_(d)  # m <- momentum m + d
                p.sub_(torch.mul(m, self.opt.server_lr, out=tmp))  # p <- p - lr m
        new.update({PHI + n: p for n, p in params.items()})
        new.update({MOMENTUM + n: m for n, m in moms.items()})
        return global_state, new
