"""A new method in 40 lines, compared with FedAvg: FedAvg with LogitNorm as the local loss.

LogitNorm (Wei et al., ICML 2022, Eq. 6) trains on logits divided by tau times their norm, so a
client cannot lower its loss by only growing the logits of the few classes it holds. The class
below is everything fedskew needs: options (a pydantic model, with the values a benchmark searches)
and the local loss; the rest is FedAvg's. Registered, it runs on both executors, in sweeps, benches
and reports like a built-in method::

    python examples/custom_method.py                                             # FedAvg vs LogitNorm, 3 seeds
    fedskew run --import examples/custom_method.py method=logitnorm method.tau=0.05   # one run
    fedskew bench label-skew --scale smoke --import examples/custom_method.py --methods fedavg,logitnorm

How the loss reaches the global model: each selected client trains the received global model on
``local_loss`` for E epochs of SGD (the executor takes the gradient of the loss with respect to the
model's parameters), uploads the trained model (``after_training``, FedAvg's: the model itself), and
the server's ``aggregate`` averages the uploads weighted by the clients' sample counts into the next
global model. A method that changes what is sent or how it is averaged overrides those two hooks too.
"""

import torch.nn.functional as F
from pydantic import Field

import fedskew
from fedskew.algorithms.base import FedAvgOptions


class LogitNormOptions(FedAvgOptions):
    # the values `fedskew bench` tries for this option (with the learning rate times 1/3, 1 and 3)
    search = {"tau": [0.05, 0.1, 0.5]}
    tau: float = Field(0.1, gt=0, description="temperature: logits / (tau * ||logits||)")


@fedskew.register_method
class LogitNorm(fedskew.Method):
    """FedAvg whose local loss is CE(f / (tau ||f||), y) (LogitNorm, Eq. 6); evaluation uses the
    plain logits (the argmax is the same)."""

    name = "logitnorm"
    Options = LogitNormOptions

    def local_loss(self, fwd, params, x, y, payload, client_state):
        _, logits = fwd(x)  # features and logits of the model being trained, on this batch
        norms = logits.norm(dim=1, keepdim=True).clamp(min=1e-7)
        # returns the loss the client minimises and extra values to log (none here)
        return F.cross_entropy(logits / (self.opt.tau * norms), y), {}

    # Left as FedAvg's (fedskew.Method): after_training uploads the trained model, and
    # aggregate(server_state, global_state, uploads, reports) averages the uploads with the weights
    # of client_weights(reports) (the clients' sample counts) into the next global model.


if __name__ == "__main__":  # the sweep's worker processes import this file again
    spec = {"name": "logitnorm-vs-fedavg",
            "base": {"partition": {"name": "pcdd", "num_clients": 20, "classes_per_client": 3},
                     "model": {"name": "mlp", "hidden": [128, 64]}, "rounds": 30, "executor": "vectorized"},
            "methods": ["fedavg", {"name": "logitnorm", "options": {"tau": [0.05, 0.1]}}],
            "seeds": [0, 1, 2]}
    sweep_dir = fedskew.sweep(spec, jobs=2)
    rows = fedskew.load_results(sweep_dir, frame=False)
    for label in ("fedavg", "logitnorm"):
        chosen = [r for r in rows if r["label"] == label and r["selected"]]
        accs = [100 * r["global/test_acc_mean_last10"] for r in chosen]
        mean = sum(accs) / len(accs)
        std = (sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) ** 0.5
        tau = chosen[0].get("option/tau", "")
        print(f"{label:10s} {'tau ' + str(tau) if tau else '':9s} global/test_acc_mean_last10 {mean:.2f} +- {std:.2f}")
    print("report:", fedskew.report(sweep_dir)[0])
