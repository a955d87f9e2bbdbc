"""gpfl: GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized Feature
Information"; TsingZ0/GPFL ``clientgp.py``, ``servergp.py``, ``run_me.sh``; PFLlib's ``clientgpfl.py`` is the
same arithmetic). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedskew.algorithms.base import HEAD, MODEL, FedAvgOptions, Source, builtin
from fedskew.algorithms.compose import PartialSharing
from fedskew.models.nets import ConditionalValve, valve_apply


class GPFLOptions(FedAvgOptions):
    search = {"lam": [0.001, 0.01, 0.1]}  # the bench's search space (fedskew bench)
    lam: float = Field(0.01, ge=0, description=
        "lambda, weight of the alignment ||f_G - e_y|| (Frobenius norm over the batch) of the generic features with "
        "the received category embeddings (the authors' run_me.sh for CNNs and MLPs: 0.01)")
    mu: float = Field(0.1, ge=0, description=
        "L2 penalty (mu/2) ||theta||^2 on the valve and the category embeddings (the authors' optimisers' weight "
        "decay for them; run_me.sh for CNNs and MLPs: 0.1)")


@builtin
class GPFL(PartialSharing):
    """GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized Feature
    Information"; TsingZ0/GPFL ``clientgp.py``, ``servergp.py``, ``run_me.sh``; PFLlib's
    ``clientgpfl.py`` is the same arithmetic). The model gets a conditional valve (CoV) between the
    features z and the classifier and global category embeddings (GCE) e_1..e_C
    (``GPFL.build_model``). Client k's loss:
    CE(head_k(CoV(z, p_k)), y) + CE(cos(CoV(z, g_k), e), y) + lam ||CoV(z, g_k) - e'_y|| + (mu/2)
    ||theta_CoV, GCE||^2, with e the embeddings being trained, e' the received ones (frozen), cos
    the cosine similarity without temperature, the norm the Frobenius norm over the batch (the
    official ``torch.norm(feat_G - emb, 2)``), and the conditional inputs p_k = sum_c (n_k,c / n_k)
    e^k_c (personalised) and g_k = mean_c e^k_c (generic) from the embeddings e^k the client
    trained in its previous round (zero before its first), as the official ``set_GCE`` computes
    them from the client's own GCE before it takes the global one. The body, the CoV and the GCE are sent and
    averaged (sample weights); the head stays on the client. Personalised model: the body and CoV
    with the client's head and p_k; no global model (no global head).

    Differences: the official CoV and GCE have their own SGD optimisers (weight decay mu, no
    momentum) and the rest SGD without weight decay; here one optimiser of the run's settings
    trains all, mu as a loss term (the same gradient; ``train/loss`` includes it). The official
    server refreshes every client's conditional inputs each round, a client not selected from the
    global embeddings it holds; here a client keeps those of its last round until it is selected
    again (the same under full participation). Down and up: body + CoV (2 d^2 + 6 d) + GCE
    (C d). Keeps the head, p_k, g_k and its label shares."""
    family = "personalized"

    name = "gpfl"
    Options = GPFLOptions
    source = Source(
        authors="Zhang et al.",
        title="GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized Federated "
              "Learning",
        venue="ICCV",
        year=2023,
        arxiv="2308.10279",
        implements="the conditional valve and the global category embeddings (the paper's Section 4)",
        code="TsingZ0/GPFL")
    requires_classifier = "linear"
    has_global_model = False
    keep = "gpfl.own."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The conditional valve (CoV) between the features and the classifier, then the global
        category embeddings (GCE), one row per class."""
        model.valve = ConditionalValve(model.feature_dim)
        model.gce = nn.Embedding(model.classifier.out_features, model.feature_dim)
        return model

    def shared(self, key):
        return not key.startswith(HEAD) and key != "valve.context"

    def client_init(self, client_id, global_state, info):
        counts = info.class_counts[client_id].to(global_state["gce.weight"])
        zeros = torch.zeros_like(global_state["gce.weight"][0])  # the authors' conditional inputs before set_GCE
        return {**super().client_init(client_id, global_state, info), "gpfl.share": counts / counts.sum(),
                "gpfl.p": zeros, "gpfl.g": zeros.clone()}

    def local_start(self, payload, client_state):
        """The received body, CoV and GCE, the client's head, and p_k as the valve's context."""
        return {**super().local_start(payload, client_state), "valve.context": client_state["gpfl.p"]}

    def after_training(self, trained, payload, client_state, report):
        """Keeps the head and the next round's conditional inputs p_k = share_k . e, g = mean_c e_c
        from the client's own trained embeddings (the authors' ``set_GCE`` reads the client's GCE
        before overwriting it with the global one)."""
        upload, kept = super().after_training(trained, payload, client_state, report)
        e = trained["gce.weight"]
        return upload, {**kept, "gpfl.share": client_state["gpfl.share"], "gpfl.p": client_state["gpfl.share"] @ e,
                        "gpfl.g": e.mean(0)}

    def personal_state(self, trained, client_state):
        """The trained model with the conditional input it will use next (the official clients are
        evaluated after ``set_GCE``)."""
        return {**trained, "valve.context": client_state["gpfl.p"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)  # head(CoV(z, p_k)): p_k is the valve's context
        received = payload[MODEL + "gce.weight"]  # the official GCE_frozen
        valve = {k[len("valve."):]: v for k, v in params.items() if k.startswith("valve.")}
        generic = valve_apply(z, client_state["gpfl.g"], valve)
        embeddings = params["gce.weight"]
        gce = fwd.cross_entropy(F.linear(F.normalize(generic, dim=-1), F.normalize(embeddings, dim=-1)), y)
        align = torch.linalg.vector_norm(generic - received[y])
        l2 = sum(v.pow(2).sum() for v in valve.values()) + embeddings.pow(2).sum()
        loss = fwd.cross_entropy(logits, y) + gce + self.opt.lam * align + 0.5 * self.opt.mu * l2
        return loss, {"gpfl/gce": gce.detach(), "gpfl/align": align.detach()}
