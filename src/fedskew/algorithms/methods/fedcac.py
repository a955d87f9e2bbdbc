"""fedcac: FedCAC (Wu, Liu, Niu, Zhu, Tang, ICCV 2023): each client marks the critical share tau of each layer's
parameters (``critical_masks``) after its local training and uploads the model with the mask. (Family
``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import (
    FedAvgOptions,
    Method,
    Source,
    State,
    add_prefix,
    as_model_part,
    builtin,
    copies,
    model_part,
    strip_prefix,
    weighted_mean,
)


class FedCACOptions(FedAvgOptions):
    search = {"tau": [0.3, 0.5, 0.7], "beta": [20, 100]}  # the bench's search space (fedskew bench)
    tau: float = Field(0.5, gt=0, le=1, description="share of each layer's parameters that are critical (the largest "
                                                    "|Delta theta * theta|)")
    beta: int = Field(100, ge=1, description="the collaboration threshold rises from the mean overlap to the largest "
                                             "by (t + 1) / beta per round t")


def critical_masks(start: State, trained: State, names, tau: float) -> State:
    """FedCAC's critical parameters of each layer (Wu et al., Sec. 3.2; Fling's
    ``evaluate_critical_parameter``): c = |(theta - theta_start) * theta|; the int(tau n) largest of
    a layer's n entries are critical (c >= the smallest of them; if that is <= 1e-10, the smallest
    c above 1e-20 is the threshold instead). 1 marks a critical entry."""
    out = {}
    for n in names:
        c = ((trained[n] - start[n]) * trained[n]).abs()
        metric = c.reshape(-1)
        k = int(tau * metric.numel())
        # the k-th largest (topk(metric, k).values[-1], by selection: a quarter of topk's time)
        thresh = torch.kthvalue(metric, metric.numel() - k + 1).values if k > 0 else torch.tensor(float("inf"))
        if thresh <= 1e-10:
            nonzero = metric[metric > 1e-20]
            if len(nonzero):
                thresh = nonzero.min()
        out[n] = (c >= thresh).to(trained[n].dtype)
    return out


def overlap_matrix(masks: torch.Tensor) -> torch.Tensor:
    """overlap[i, j] = 1 - sum |m_i - m_j| / (2 sum m_i) of clients' flattened critical masks (rows).
    For 0/1 masks sum |m_i - m_j| = sum m_i + sum m_j - 2 m_i . m_j, integers that float64 holds
    exactly (the pairwise difference tensor was clients^2 x parameters floats)."""
    m = masks.double()
    sums = m.sum(1)
    diff = (sums[:, None] + sums[None, :] - 2 * (m @ m.T)).to(masks.dtype)
    return 1 - diff / (2 * masks.sum(1, keepdim=True))


@builtin
class FedCAC(Method):
    """FedCAC (Wu, Liu, Niu, Zhu, Tang, ICCV 2023): each client marks the critical share tau of each
    layer's parameters (``critical_masks``) after its local training and uploads the model with the
    mask. The server averages FedAvg's global model, and for every client of the round a customised
    model: the plain mean of the trained models of it and of the round's clients whose masks overlap
    its own by at least the threshold mean + (t + 1) / beta (max - mean) (``overlap_matrix``; round t
    counted from 0, so collaboration narrows as training goes on). A client starts its next round from
    its critical parameters taken from its customised model and the others from the global model
    (``local_start``). The personalised model is the trained one (Fling's 'before aggregation'); the
    final pass starts from the mixture (its 'after aggregation')."""
    family = "sharing"

    name = "fedcac"
    Options = FedCACOptions
    source = Source(authors="Wu, Liu, Niu, Zhu, Tang",
                    title="Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through "
                          "Cautiously Aggressive Collaboration",
                    venue="ICCV", year=2023, arxiv="2309.11103",
                    implements="Sec. 3 (critical parameter selection, overlap threshold, customised global models)",
                    code="kxzxvbk/Fling fling/component/client/fedcac_client.py, group/fedcac_group.py, "
                         "flzoo/cifar10/cifar10_fedcac_resnet_config.py (tau 0.5, beta 100); PFLlib servercac.py")
    per_sample_loss = True  # Method.padding_exact (FedAvg's loss)

    def server_init(self, global_state, info):
        state = copies(global_state, info.num_clients, "cac.custom.")
        return {**state, "cac.round": torch.zeros((), dtype=torch.long)}

    def client_init(self, client_id, global_state, info):
        # no critical entry before the first training: the first round starts from the global model
        return {"cac.mask." + k: torch.zeros_like(global_state[k]) for k in info.param_names}

    def download(self, server_state, client_id, round_idx):
        return {"cac.model." + k[len("cac.custom."):]: v[client_id] for k, v in server_state.items()
                if k.startswith("cac.custom.")}

    def local_start(self, payload, client_state):
        glob = model_part(payload)
        custom = strip_prefix(client_state, "cac.model.")
        return {k: g + client_state["cac.mask." + k] * (custom[k] - g) if "cac.mask." + k in client_state else g
                for k, g in glob.items()}

    def after_training(self, trained, payload, client_state, report):
        start = self.local_start(payload, client_state)
        masks = critical_masks(start, trained, self.info.param_names, self.opt.tau)
        return ({**as_model_part(trained), **add_prefix(masks, "cac.critical.")},
                add_prefix(masks, "cac.mask."))

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        state = {k: v.clone() if k.startswith("cac.custom.") else v for k, v in server_state.items()}
        n, names = len(uploads), self.info.param_names
        together = torch.ones(n, n, dtype=torch.bool)
        if n > 1:
            masks = torch.stack(
                [torch.cat([u["cac.critical." + k].reshape(-1).double() for k in names]) for u in uploads]
            )
            overlap = overlap_matrix(masks)
            off = ~torch.eye(n, dtype=torch.bool)
            mean, top = overlap[off].mean(), overlap[off].max()
            t = int(server_state["cac.round"])
            threshold = mean + (t + 1) / self.opt.beta * (top - mean)
            together = (overlap >= threshold) | ~off
        models = [model_part(u) for u in uploads]
        for i, r in enumerate(reports):
            peers = [models[j] for j in range(n) if together[i, j]]
            custom = weighted_mean(peers, torch.full((len(peers),), 1.0 / len(peers), dtype=torch.float64))
            for k, v in custom.items():
                state["cac.custom." + k][r.client_id] = v
        state["cac.round"] = server_state["cac.round"] + 1
        return new, state
