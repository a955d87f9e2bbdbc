"""fedcp: FedCP (Zhang et al., KDD 2023, "FedCP: Separating Feature Information for Personalized Federated Learning
via Conditional Policy"; TsingZ0/FedCP ``clientcp.py``, ``servercp.py``, ``run_me.sh``; PFLlib's ``clientcp.py``
is the same arithmetic). (Family ``personalized``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
from pydantic import Field

from fedskew.algorithms.base import HEAD, MODEL, FedAvgOptions, Source, builtin, model_part
from fedskew.algorithms.compose import PartialSharing
from fedskew.models.nets import ConditionalPolicy
from fedskew.streams import torch_seed


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths=(10.0, 15.0, 20.0, 50.0)) -> torch.Tensor:
    """FedCP's MMD between two batches of features (TsingZ0/FedCP ``MMD(x, y, 'rbf')``): the mean
    over all pairs of sum_a [exp(-||x_i - x_j||^2 / 2a) + exp(-||y_i - y_j||^2 / 2a) - 2
    exp(-||x_i - y_j||^2 / 2a)], squared distances from the Gram matrices as the official code
    computes them, fixed bandwidths a (not scaled to the data)."""
    xx, yy, zz = x @ x.T, y @ y.T, x @ y.T
    rx, ry = xx.diagonal().unsqueeze(0).expand_as(xx), yy.diagonal().unsqueeze(0).expand_as(yy)
    dxx, dyy, dxy = rx.T + rx - 2 * xx, ry.T + ry - 2 * yy, rx.T + ry - 2 * zz
    k = sum(torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2 * torch.exp(-0.5 * dxy / a) for a in bandwidths)
    return k.mean()


class FedCPOptions(FedAvgOptions):
    search = {"lam": [0.5, 5.0, 50.0]}  # the bench's search space (fedskew bench)
    lam: float = Field(5.0, ge=0, description=
        "lambda, weight of the MMD between the features of the trained body and of the received global body "
        "(frozen) (the authors' run_me.sh: 5; main.py's default 0)")


@builtin
class FedCP(PartialSharing):
    """FedCP (Zhang et al., KDD 2023, "FedCP: Separating Feature Information for Personalized
    Federated Learning via Conditional Policy"; TsingZ0/FedCP ``clientcp.py``, ``servercp.py``,
    ``run_me.sh``; PFLlib's ``clientcp.py`` is the same arithmetic). The model gets a conditional
    policy network (CPN) and a global head beside the client's head (``FedCP.build_model``,
    :class:`~fedskew.models.nets.ConditionalPolicy`): per sample, a Gumbel-softmax
    policy splits the features z into z * s_p for the client's head and z * s_g for the global
    head, conditioned on the client's context c = the row sum of its head's weights. Client k's
    loss: CE(head_p(z s_p) + head_g(z s_g), y) + lam MMD(z, z_G), z_G the received body's features
    of the same batch (frozen), MMD with the official fixed RBF bandwidths (:func:`mmd_rbf`). The
    global head is not trained locally. Up: the body, the CPN and head_g' = (head_p + head_g) / 2
    (the official ``generate_upload_head``); the server averages them (sample weights). The client
    keeps its head and its context, set after training from the trained head (the official
    ``set_head_g``); before its first round the context is uniform in [0, 1)^d (the official
    ``torch.rand``; stream ``fedcp_context``). No global model: the policy needs a client's head.

    Differences: one optimiser of the run's settings (the official plain SGD is momentum 0, no
    weight decay); the received body's features for the MMD come from an eval-mode pass (the
    official frozen copy runs in train mode: the same without BatchNorm). The official server
    sends the new body to every client each round but the new CPN and global head only to that
    round's clients; here a client gets all three when selected (the same under full
    participation, the official protocol). The official evaluation scores the received body, CPN
    and global head with the client's head and context, which is fedskew's ``personal/acc_before``;
    ``personal/acc_after`` scores the trained model. The Gumbel noise makes the method random in
    training and evaluation, so the vectorised executor runs it sequentially."""
    family = "personalized"

    name = "fedcp"
    Options = FedCPOptions
    source = Source(
        authors="Zhang et al.",
        title="FedCP: Separating Feature Information for Personalized Federated Learning via Conditional Policy",
        venue="KDD",
        arxiv="2307.01217", year=2023,
        implements="the conditional policy network and its feature split (the paper's Section 4)",
        code="TsingZ0/FedCP")
    requires_classifier = "linear"
    has_global_model = False
    vectorizable = False  # Gumbel noise (random masks under vmap cannot match the sequential executor's)
    keep = "fedcp.own."

    @classmethod
    def build_model(cls, model, options, rebuild):
        """The conditional policy network (CPN) and a global head equal to the head at first (the
        official ``head_g = deepcopy(head)``)."""
        head = model.classifier
        model.policy = ConditionalPolicy(model.feature_dim, head.out_features, head.bias is not None)
        model.policy.head_g.load_state_dict(head.state_dict())
        return model

    def shared(self, key):
        return not key.startswith(HEAD) and key != "policy.context"

    def client_init(self, client_id, global_state, info):
        gen = torch.Generator().manual_seed(torch_seed(info.seed, "fedcp_context", client_id))
        context = torch.rand(global_state["policy.context"].shape, generator=gen).to(global_state["policy.context"])
        return {**super().client_init(client_id, global_state, info), self.keep + "policy.context": context}

    def trained_params(self, stage):
        return frozenset(k for k in self.info.param_names if not k.startswith("policy.head_g."))

    def after_training(self, trained, payload, client_state, report):
        """Uploads the body, the CPN and (head_p + head_g) / 2; keeps the trained head and the next
        context, the row sum of its weights."""
        upload, kept = super().after_training(trained, payload, client_state, report)
        for name in ("weight", "bias"):
            if HEAD + name in trained:
                upload[MODEL + "policy.head_g." + name] = (
                    0.5 * trained[HEAD + name] + 0.5 * trained["policy.head_g." + name]
                )
        return upload, {**kept, self.keep + "policy.context": trained[HEAD + "weight"].sum(0)}

    def personal_state(self, trained, client_state):
        """The trained model with the context it will use next."""
        return {**trained, "policy.context": client_state[self.keep + "policy.context"]}

    def local_loss(self, fwd, params, x, y, payload, client_state):
        z, logits = fwd(x)
        z_global, _ = fwd.frozen(model_part(payload), x)
        mmd = mmd_rbf(z, z_global)
        return fwd.cross_entropy(logits, y) + self.opt.lam * mmd, {"fedcp/mmd": mmd.detach()}
