"""fedem: FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021, Algorithm 1): every client's data is a
mixture of M shared components, p_k(y|x) = sum_m pi_km p_m(y|x); the model is the M components
(:class:`~fedskew.models.nets.MixtureNet`), the client keeps its weights pi_k. (Family ``personalized``; the
class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Method, Source, builtin, model_part

MIX = "classifier.mix"  # the mixture weights pi (MixtureNet's buffer)


class FedEMOptions(FedAvgOptions):
    search = {"learners": [2, 3, 5]}  # the bench's search space (fedskew bench)
    learners: int = Field(3, ge=1, le=16, description="M, the mixture's components (models of the configured "
                                                      "architecture, each its own initialisation)")


@builtin
class FedEM(Method):
    """FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021, Algorithm 1): every client's
    data is a mixture of M shared components, p_k(y|x) = sum_m pi_km p_m(y|x); the model is the M
    components (:class:`~fedskew.models.nets.MixtureNet`), the client keeps its weights pi_k. Each
    round, before training (E-step, ``prepare``): q_i(m) = softmax_m(log pi_km - CE(theta_m; x_i,
    y_i)) over the client's samples under the received components (eval mode), then pi_k <- mean_i
    q_i. Local training (M-step): the batch mean of sum_m q_i(m) CE(theta_m; x_i, y_i), q_i computed
    from the received components (FL-bench's per-sample weights: the same numbers). The server
    averages the components as FedAvg; the global model's pi is the n_k-weighted mean of the
    round's pi_k (the mixture the population would use), the personalised model the components
    with the client's own pi_k."""
    family = "personalized"

    name = "fedem"
    Options = FedEMOptions
    source = Source(authors="Marfoq, Neglia, Bellet, Kameni, Vidal",
                    title="Federated Multi-Task Learning under a Mixture of Distributions",
                    venue="NeurIPS", year=2021, arxiv="2108.10252",
                    implements="Algorithm 1 (E-step over the local samples, pi update, weighted M-step; FedAvg of "
                               "the components)",
                    code="KarhouTam/FL-bench src/client/fedem.py, src/server/fedem.py (n_learners 3)")
    requires_classifier = "linear"
    per_sample_loss = True  # Method.padding_exact

    @classmethod
    def build_model(cls, model, options, rebuild):
        """M components: the configured model and M - 1 more draws of its configuration."""
        from fedskew.models.nets import MixtureNet

        return MixtureNet([model, *(rebuild() for _ in range(options.learners - 1))])

    def client_init(self, client_id, global_state, info):
        uniform = torch.full_like(global_state[MIX], 1.0 / len(global_state[MIX]))
        return {"em.pi": uniform, "em.prior": uniform}

    def responsibilities(self, per_learner_logits, y, prior):
        """q_i(m) = softmax_m(log pi_m - CE(theta_m; x_i, y_i)) from the learners' logits [B, M C]."""
        m = len(prior)
        logp = F.log_softmax(per_learner_logits.reshape(len(y), m, -1), -1)
        nll = -logp.gather(2, y[:, None, None].expand(-1, m, 1)).squeeze(2)  # [B, M]
        return torch.softmax(torch.log(prior) - nll, 1), nll

    def prepare(self, payload, client_state, data):
        with torch.no_grad():
            z, _ = data.frozen(model_part(payload), data.x)
            q, _ = self.responsibilities(z, data.y, client_state["em.pi"].to(z))
        return {**client_state, "em.prior": client_state["em.pi"], "em.pi": q.mean(0).to(client_state["em.pi"])}

    def local_start(self, payload, client_state):
        return {**model_part(payload), MIX: client_state["em.pi"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, _ = fwd(x)
        z0, _ = fwd.frozen(model_part(payload), x)
        q, _ = self.responsibilities(z0, y, client_state["em.prior"])
        _, nll = self.responsibilities(z, y, client_state["em.prior"])
        return fwd.mean((q.detach() * nll).sum(1)), {}

    def personal_state(self, trained, client_state):
        return {**trained, MIX: client_state["em.pi"]}
