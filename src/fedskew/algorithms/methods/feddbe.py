"""feddbe: FedDBE, FedAvg + domain bias eliminator (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias for
Federated Learning in Representation Space"; TsingZ0/DBE ``clientDBE.py``, ``serverDBE.py``, ``run_me.sh``, the
same code as PFLlib's ``clientdbe.py``). (Family ``sharing``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.compose import PartialSharing


class FedDBEOptions(FedAvgOptions):
    search = {"kl_weight": [0.5, 5.0, 50.0]}  # the bench's search space (fedskew bench)
    kl_weight: float = Field(50.0, ge=0, description=
        "kappa, weight of the mean regularisation (MR) 0.5 mean_j (mean_batch z_j - global mean_j)^2; the authors' "
        "run_me.sh uses 50 (PFLlib's argparse default 0 turns MR off)")


@builtin
class FedDBE(PartialSharing):
    """FedDBE, FedAvg + domain bias eliminator (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias
    for Federated Learning in Representation Space"; TsingZ0/DBE ``clientDBE.py``,
    ``serverDBE.py``, ``run_me.sh``, the same code as PFLlib's ``clientdbe.py``). Each client keeps
    a personalised representation bias (PRBM) mu_k, a trainable vector added to the features before
    the classifier (``FedDBE.build_model``: logits = W (z + mu_k) + b), and trains
    it with the model on CE(W (z + mu_k) + b, y) + kappa * 0.5 mean_j (zbar_j - zbar^g_j)^2 (the run's
    SGD; the authors' client steps mu_k with its own plain SGD at the same lr, no momentum), the
    mean regularisation (MR) pulling the batch's mean feature zbar (before mu_k) to the global
    mean zbar^g. The model without mu_k is sent and averaged as FedAvg's; mu_k never leaves the
    client (zeros at first). Personalised model: the trained model with mu_k; global model: without.

    The global mean: the authors compute it once, before round 0, from an extra local-training
    pass of every client (an "initialization period" whose models are discarded), as the clients'
    sample-weighted last-batch feature means. fedskew folds that period into round 0: round 0
    trains head(z) without MR and without mu_k (which stays 0, as the authors' client leaves it
    out until a global mean exists), each client also sends its mean feature over its local training data (d
    floats, eval mode, after training), the server keeps their sample-weighted mean, and MR is on
    from round 1 (only round 0's clients contribute when clients are sampled). Their running mean
    with ``-mo 1`` (their script's) is the batch mean used here; an EMA across steps (mo < 1) is not
    built. mu_k trains with the run's optimizer (their separate optimizer has no momentum).

    Down: the model without mu_k, and the global mean (d). Up: the model without mu_k (+ d in
    round 0). Keeps mu_k (d floats) per client."""
    family = "sharing"

    name = "feddbe"
    Options = FedDBEOptions
    source = Source(
        authors="Zhang et al.",
        title="Eliminating Domain Bias for Federated Learning in Representation Space",
        venue="NeurIPS",
        arxiv="2311.14975", year=2023,
        implements="the personalised representation bias memory and the mean regulariser (the paper's Section 4)",
        code="TsingZ0/DBE")
    keep = "dbe."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The PRBM: a trainable vector added to the features before the classifier, zeros as the
        official client_mean starts (logits = W (z + mu_k) + b)."""
        model.shift = nn.Parameter(torch.zeros(model.feature_dim))
        return model

    def shared(self, key):
        return key != "shift"

    def broadcast(self, global_state, server_state):
        payload = super().broadcast(global_state, server_state)
        if "dbe.global_mean" in server_state:
            payload["dbe.global_mean"] = server_state["dbe.global_mean"]
        return payload

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """CE(W (z + mu_k) + b, y) + kappa * 0.5 mean_j (zbar_j - zbar^g_j)^2 (DBE's MR; from the
        round after the global mean is known: the phase is in the payload's keys)."""
        z, logits = fwd(x)
        if "dbe.global_mean" not in payload:
            # the authors' initialisation period: head(rep), mu_k left out (clientDBE.train), so it stays 0
            return fwd.cross_entropy(fwd.head(z), y), {}
        loss = fwd.cross_entropy(logits, y)
        mr = 0.5 * (z.mean(0) - payload["dbe.global_mean"]).pow(2).mean()
        return loss + self.opt.kl_weight * mr, {"dbe/mr": mr.detach()}

    def after_training(self, trained, payload, client_state, report):
        upload, kept = super().after_training(trained, payload, client_state, report)
        if "dbe.global_mean" not in payload:  # round 0: the client's mean feature, for the global mean
            z, _ = report.local_features(trained)
            upload["dbe.mean"] = z.mean(0)
        return upload, kept

    def aggregate(self, server_state, global_state, uploads, reports):
        new, server_state = super().aggregate(server_state, global_state, [
            {k: v for k, v in u.items() if k != "dbe.mean"} for u in uploads], reports)
        if "dbe.mean" in uploads[0]:
            n = torch.tensor([r.num_samples for r in reports], dtype=torch.float64)
            mean = sum(w * u["dbe.mean"].double() for w, u in zip((n / n.sum()).tolist(), uploads))
            server_state = {**server_state, "dbe.global_mean": mean.to(uploads[0]["dbe.mean"].dtype)}
        return new, server_state
