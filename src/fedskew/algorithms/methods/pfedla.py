"""pfedla: pFedLA (Ma, Zhang, Guo and Xu, CVPR 2022): a server hypernetwork per client weighs every client's model
layer by layer into that client's personalised model. (Family ``hypernetwork``; the class's docstring has the
details.)"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import Method, Source, StrictOptions, builtin, check_size, model_part
from fedskew.streams import seeded_torch

HN, MODELS, SENT = "la.hn.", "la.models.", "la.w."  # per-client hypernetworks, every client's model, the download


class PFedLAOptions(StrictOptions):
    search = {"hn_lr": [0.001, 0.005, 0.02]}  # the bench's search space (fedskew bench)
    embed_dim: int = Field(100, ge=1, le=1 << 12, description="size of each client's embedding (FL-bench's 100)")
    hidden: int = Field(100, ge=1, le=1 << 12, description="width of the hypernetwork's three layers (100)")
    hn_lr: float = Field(0.005, gt=0, description="the hypernetworks' SGD learning rate (FL-bench's hn_lr 5e-3)")
    layers: Literal["tensor", "module"] = Field(
        "tensor", description="what one aggregation weight vector covers: each parameter tensor (FL-bench) or each "
                              "module, its weight and bias together (FL-bench in 2023)")
    heuristic_k: int = Field(0, ge=0, description="HeurpFedLA: the k layers with the largest self-weight keep the "
                                                  "client's own parameters (0: pFedLA)")
    sign: Literal["descent", "flbench"] = Field(
        "descent", description="the hypernetwork's step: towards the client's trained model (descent on "
                               "<theta_bar, theta_bar - theta~>, pFedHN's rule) or away from it (FL-bench's "
                               "grad_outputs = theta~ - theta_bar)")


def layer_groups(names, how: str) -> list[list[str]]:
    """The model's layers: each parameter tensor, or each module (the name without its last part)."""
    if how == "tensor":
        return [[n] for n in names]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 1)[0], []).append(n)
    return list(groups.values())


def aggregation_weights(hn: dict, client_id: int, num_layers: int, k: int) -> list[torch.Tensor]:
    """Client i's weights over the N clients for each layer: h = three (Linear, ReLU) on its embedding,
    a_l = ReLU(U_l h + c_l), w_l = a_l / sum(a_l) (one-hot(i) where a_l sums to 0, as FL-bench); with k,
    the k layers of largest raw self-weight a_l[i] one-hot(i), without gradient (HeurpFedLA)."""
    h = hn["emb"][client_id]
    for i in range(3):
        h = F.relu(F.linear(h, hn[f"l{i}.w"], hn[f"l{i}.b"]))
    raw = [F.relu(F.linear(h, hn[f"head{layer}.w"], hn[f"head{layer}.b"])) for layer in range(num_layers)]
    own = F.one_hot(torch.tensor(client_id), raw[0].shape[0]).to(raw[0])
    kept = set(torch.topk(torch.stack([a[client_id].detach() for a in raw]), k).indices.tolist()) if k else set()
    return [own if layer in kept or float(a.detach().sum()) == 0.0 else a / a.sum() for layer, a in enumerate(raw)]


def personalised(models: dict, weights: list[torch.Tensor], groups: list[list[str]]) -> dict:
    """theta_bar_i^l = sum_j w_l[j] theta_j^l for every layer l (its tensors)."""
    return {n: torch.tensordot(w, models[n], dims=1) for w, names in zip(weights, groups) for n in names}


@builtin
class PFedLA(Method):
    """pFedLA (Ma, Zhang, Guo and Xu, CVPR 2022, "Layer-wised Model Aggregation for Personalized
    Federated Learning"), as FL-bench runs it (``src/server/pfedla.py``; the paper's authors published no
    code). The server keeps every client's model theta_j and, per client, a hypernetwork: an embedding
    v_i, three (Linear, ReLU) layers and a linear head per layer of the model with a ReLU, whose output
    normalised to sum 1 weighs the N clients' layers (``aggregation_weights``). A selected client
    downloads theta_bar_i = sum_j w_l[j] theta_j^l layer by layer (``personalised``), trains it, and
    uploads the trained theta~_i; the server steps its hypernetwork by SGD (hn_lr 5e-3) with the gradient
    of <theta_bar_i, theta_bar_i - theta~_i> (``sign=descent``, pFedHN's rule: theta_bar moves towards
    theta~; FL-bench's grad_outputs moves it away, ``sign=flbench``) and stores theta_i = theta~_i.

    Differences from FL-bench: it processes a round's clients one after another, each mixing the models
    the ones before stored; here every download of a round mixes the models of the round's start.
    FL-bench's client loads its own stored model over the downloaded mixture (so it trains and scores
    local models only); here the client trains the mixture, as the paper's Figure 2 and FL-bench in
    2023 do. The clients' models start from the run's initial model; BatchNorm statistics are the
    client's own. No global model: ``personal/acc_before`` scores theta_bar_i, ``acc_after`` theta~_i.
    Down and up: one model per client; the server keeps N models and N hypernetworks."""
    family = "hypernetwork"

    name = "pfedla"
    Options = PFedLAOptions
    source = Source(
        authors="Ma, Zhang, Guo, Xu",
        title="Layer-wised Model Aggregation for Personalized Federated Learning",
        venue="CVPR",
        year=2022,
        arxiv="2205.03993",
        implements="the layer-wise aggregation weights from a per-client hypernetwork and their update "
                   "(Section 3, Algorithm 1; HeurpFedLA)",
        code="KarhouTam/FL-bench (src/server/pfedla.py at 06e658b; no code by the paper's authors)")
    has_global_model = False
    fedavg_weighted = False  # the server stores each client's model (Method.fedavg_weighted)
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        if info is not None:
            o, n = self.opt, info.num_clients
            self.groups = layer_groups(info.param_names, o.layers)
            per = o.embed_dim * n + (o.embed_dim + 1) * o.hidden + 2 * (o.hidden + 1) * o.hidden
            check_size("pfedla", "hypernetworks", n * (per + len(self.groups) * (o.hidden + 1) * n)
                       + n * info.param_numel)

    def server_init(self, global_state, info):
        """One hypernetwork from the seed (stream ``pfedla``: nn.Embedding's N(0, 1), nn.Linear's
        default, the heads U(0, 1) with zero bias, as FL-bench's), copied for every client (FL-bench
        keeps a copy of one state per client); every client's model the run's initial one."""
        o, n = self.opt, info.num_clients
        with seeded_torch(info.seed, "pfedla"):
            layers = {"emb": nn.Embedding(n, o.embed_dim), "l0": nn.Linear(o.embed_dim, o.hidden),
                      "l1": nn.Linear(o.hidden, o.hidden), "l2": nn.Linear(o.hidden, o.hidden)}
            heads = {f"head{layer}": nn.Linear(o.hidden, n) for layer in range(len(self.groups))}
            for head in heads.values():
                nn.init.uniform_(head.weight, 0.0, 1.0)
                nn.init.zeros_(head.bias)
        device = next(iter(global_state.values())).device
        one = {"emb": layers["emb"].weight.detach()}
        for name, layer in {**layers, **heads}.items():
            if name != "emb":
                one.update({f"{name}.w": layer.weight.detach(), f"{name}.b": layer.bias.detach()})
        state = {HN + k: v.to(device)[None].repeat(n, *[1] * v.dim()) for k, v in one.items()}
        state.update({MODELS + k: v[None].repeat(n, *[1] * v.dim()) for k, v in global_state.items()})
        return state

    def hypernetwork(self, server_state: dict, client_id: int) -> dict:
        return {k[len(HN):]: v[client_id] for k, v in server_state.items() if k.startswith(HN)}

    def models(self, server_state: dict) -> dict:
        return {k[len(MODELS):]: v for k, v in server_state.items() if k.startswith(MODELS)}

    def broadcast(self, global_state, server_state):
        return {}  # every client gets its own mixture (download)

    def download(self, server_state, client_id, round_idx):
        models = self.models(server_state)
        with torch.no_grad():
            w = aggregation_weights(self.hypernetwork(server_state, client_id), client_id, len(self.groups),
                                    self.opt.heuristic_k)
            mixed = personalised(models, w, self.groups)
        own = {k: v[client_id] for k, v in models.items() if k not in mixed}  # BatchNorm statistics: its own
        return {SENT + k: v for k, v in {**mixed, **own}.items()}

    def local_start(self, payload, client_state):
        return {k[len(SENT):]: v for k, v in client_state.items() if k.startswith(SENT)}

    def after_training(self, trained, payload, client_state, report):
        return {"model." + k: v for k, v in trained.items()}, {k: v for k, v in client_state.items()
                                                                if not k.startswith(SENT)}

    def aggregate(self, server_state, global_state, uploads, reports):
        """Per client of the round: the SGD step of its hypernetwork with the gradient of
        <theta_bar_i, G> (G = theta_bar_i - theta~_i, or its negative with ``sign=flbench``), the
        layers HeurpFedLA keeps left out; then theta_i = theta~_i."""
        new, models = dict(server_state), self.models(server_state)
        for upload, report in zip(uploads, reports):
            i, trained = report.client_id, model_part(upload)
            hn = {k: v.detach().requires_grad_(True) for k, v in self.hypernetwork(server_state, i).items()}
            with torch.enable_grad():
                w = aggregation_weights(hn, i, len(self.groups), self.opt.heuristic_k)
                mixed = personalised(models, w, self.groups)
                outs = [(v, (v.detach() - trained[k]) * (1 if self.opt.sign == "descent" else -1))
                        for k, v in mixed.items() if v.requires_grad]
                grads = torch.autograd.grad([o for o, _ in outs], list(hn.values()),
                                            grad_outputs=[g for _, g in outs], allow_unused=True) if outs else ()
            for (k, v), g in zip(hn.items(), grads):
                if g is not None:
                    new[HN + k] = new[HN + k].index_copy(0, torch.tensor([i], device=v.device),
                                                         (v.detach() - self.opt.hn_lr * g)[None])
            for k, v in trained.items():
                new[MODELS + k] = new[MODELS + k].index_copy(0, torch.tensor([i], device=v.device), v[None])
        return global_state, new
