"""fedcog: FedCOG (Ye, Wang, Chen, Chen, Wang, ICLR 2024, "Fake It Till Make It"): each client synthesises inputs
the global model labels with the classes it lacks and its own previous model disagrees on, then trains on its data
plus distillation from the global model on them. (Family ``distillation``; the class's docstring has the details.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedskew.algorithms.base import MODEL, FedAvgOptions, Method, Source, builtin, model_part
from fedskew.algorithms.tensors import adam_step, kd_loss
from fedskew.streams import torch_seed

START = 5 / 7  # the share of the rounds before generation by default: the code's run.sh runs 70, generating from 50
KEPT = "cog.local."  # the client's model as its last local training left it (the generation's student)
# the round's synthetic inputs, their teacher logits, which are real (not padding), the own samples' partners, w_syn
SYN_X, SYN_T, SYN_W, PAIR, W_SYN = "cog.sx", "cog.st", "cog.sw", "cog.pair", "cog.wsyn"


class FedCOGOptions(FedAvgOptions):
    search = {"adv": [0.05, 0.1, 0.3]}  # the bench's search space (fedskew bench)
    start_round: int | None = Field(None, ge=0, description=
        "rounds of plain FedAvg before generation starts; None: the first 5/7 of the run (the code's run.sh: 50 of 70)")
    synthesis_size: int = Field(256, ge=1, le=1 << 16, description=
        "synthetic inputs per client and round, shared among its missing classes (--synthesis_batch_size 256)")
    g_steps: int = Field(500, ge=1, le=100_000, description="Adam steps on the synthetic inputs (--g_steps 500)")
    lr_g: float = Field(0.01, gt=0, description="their Adam learning rate (--lr_g 0.01; betas 0.5, 0.9)")
    oh: float = Field(1.0, ge=0, description="weight of the global model's cross-entropy on the targets (--oh 1)")
    adv: float = Field(0.1, ge=0, description="weight of the disagreement loss 1 - JS(local || global) (--adv 0.1)")
    js_temperature: float = Field(1.0, gt=0, description="softmax temperature of that JS divergence (--js_T 1)")
    temperature: float = Field(1.0, gt=0, description="distillation temperature of local training (--T 1)")


def complementary_plan(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """(targets, w_syn): the client's missing share of each class, delta_c = max_j n_j - n_c, turned into
    floor(size delta_c / sum delta) targets of class c (its largest class gets none), and the distillation
    weight w_syn = sum delta / (sum n + sum delta) (the code's ``syn_lr``; the real data's is 1 - w_syn).
    A client whose classes are balanced gets no targets and w_syn = 0 (the code divides 0 by 0)."""
    counts = counts.double()
    deficit = counts.max() - counts
    missing = float(deficit.sum())
    if missing <= 0:
        return torch.zeros(0, dtype=torch.long), 0.0
    per_class = [int(size * float(d) / missing) for d in deficit]
    targets = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(per_class)])
    return targets, missing / (float(counts.sum()) + missing)


def disagreement(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """1 - clamp(JS, 0, 1), JS = (KL(M || P) + KL(M || Q)) / 2 summed over classes, mean over the batch, with
    P = softmax(student / T), Q = softmax(teacher / T), M = (P + Q) / 2, each clamped to [0.01, 0.99] after M
    is formed (the code's ``jensen_shanon_div``): minimised where the two models disagree."""
    p, q = F.softmax(student / temperature, 1), F.softmax(teacher / temperature, 1)
    m = ((p + q) / 2).clamp(0.01, 0.99)
    p, q = p.clamp(0.01, 0.99), q.clamp(0.01, 0.99)
    js = ((m * (m.log() - p.log())).sum() + (m * (m.log() - q.log())).sum()) / (2 * student.shape[0])
    return 1 - js.clamp(0, 1)


def synthesise(model_call, teacher: dict, student: dict, targets: torch.Tensor, x: torch.Tensor,
               opt: FedCOGOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, teacher logits): ``x`` (drawn N(0, 1)) after ``g_steps`` Adam steps on oh CE(g(x), targets) +
    adv disagreement(l(x), g(x)), g the global model and l the client's previous one, both in eval mode; the
    logits are the teacher's at the step of lowest loss, the inputs the last ones (the code keeps
    ``inputs.data``, which the later steps overwrite)."""
    x = x.clone().requires_grad_(True)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    best, best_logits = float("inf"), None
    for step in range(1, opt.g_steps + 1):
        with torch.enable_grad():
            t = model_call(teacher, x)[1]
            s = model_call(student, x)[1]
            loss = opt.oh * F.cross_entropy(t, targets) + opt.adv * disagreement(s, t, opt.js_temperature)
            (g,) = torch.autograd.grad(loss, x)
        if best > loss.item() or best_logits is None:
            best, best_logits = loss.item(), t.detach()
        with torch.no_grad():
            adam_step(x, g, m, v, step, opt.lr_g, betas=(0.5, 0.9))
    return x.detach(), best_logits


@builtin
class FedCOG(Method):
    """FedCOG (Ye et al., ICLR 2024) as its code runs it (rui-ye/FedCOG ``fedcog.py`` and
    ``gen_utils/generate_image.py`` at cf34c0a). The first ``start_round`` rounds are FedAvg (by default the
    first 5/7 of the run, as the code's run.sh: 50 of its 70). From then on,
    before its local training a client synthesises, for the classes it lacks, ``synthesis_size`` inputs
    shared in proportion to each class's deficit max_j n_j - n_c (``complementary_plan``): ``g_steps`` Adam
    steps (lr 0.01, betas 0.5, 0.9) from N(0, 1) on oh CE(g(x), y) + adv (1 - JS(l(x), g(x))), g the received
    global model and l the client's own model as its last training left it (``synthesise``). It then trains
    the global model on (1 - w_syn) CE on its data + w_syn T^2 KL(softmax(g(x~) / T) || softmax(f(x~) / T)) on
    the synthetic inputs with the teacher logits kept at generation, w_syn = sum delta / (n + sum delta).
    The server averages as FedAvg (the real samples weigh).

    Local batches: the code draws a batch of the synthetic set (64, its own shuffled loader) with each batch
    of real data (64); here each own sample carries one synthetic sample (the engine's paired samples, as
    FedFed's), drawn without replacement from the client's set while they last, so a step sees as many
    synthetic inputs as real ones, as in the code, and a round with fewer own samples than synthetic ones
    uses a subset. The code's two backward passes are one pass on the joined batch (the same gradient
    without BatchNorm; with it, the statistics are the joined batch's). The code's 3-channel generator input
    is the data's own shape here; its DeepInversion BatchNorm term (weight 0 by default) is not offered.

    A client seen for the first time has no model of its own yet; its student is the global model it first
    received (the code's clients all train in every round, the first ``start_round`` of them FedAvg).
    Down: the model. Up: the model. The client keeps its last trained model (|theta|)."""
    family = "distillation"

    name = "fedcog"
    Options = FedCOGOptions
    source = Source(
        authors="Ye, Wang, Chen, Chen, Wang",
        title="Fake It Till Make It: Federated Learning with Consensus-Oriented Generation",
        venue="ICLR",
        year=2024,
        arxiv="2312.05966",
        implements="consensus-oriented generation (the complementary class plan, the task and disagreement "
                   "losses) and the distillation-based local training",
        code="rui-ye/FedCOG (fedcog.py, gen_utils/generate_image.py, gen_utils/generate_utils.py at cf34c0a)")
    per_sample_loss = True  # FedAvg's loss before start_round; the generation rounds pair samples (no padding)

    @classmethod
    def inert(cls, options, rounds, num_clients, clients_per_round):
        if options.start_round is not None and options.start_round >= rounds:
            return (f"method.start_round = {options.start_round} is not below the run's {rounds} rounds: no "
                    f"client ever generates, and fedcog is FedAvg throughout")
        return None

    def client_init(self, client_id, global_state, info):
        return {KEPT + k: v.clone() for k, v in global_state.items()}

    def prepare(self, payload, client_state, data):
        """From ``start_round`` on: the client's synthetic inputs, their teacher logits (padded to
        ``synthesis_size`` with weight 0) and which one each own sample carries."""
        start = self.opt.start_round if self.opt.start_round is not None else round(self.info.rounds * START)
        if data.round_idx < start or data.round_idx >= self.info.rounds:
            return client_state
        targets, w_syn = complementary_plan(self.info.class_counts[data.client_id], self.opt.synthesis_size)
        size, n = self.opt.synthesis_size, len(data.y)
        shape, device = tuple(data.x.shape[1:]), data.x.device
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, "fedcog_inputs", data.round_idx,
                                                       data.client_id))
        x = torch.zeros((size, *shape), dtype=data.x.dtype, device=device)
        logits = torch.zeros((size, self.info.num_classes), dtype=data.x.dtype, device=device)
        valid = len(targets)
        if valid:
            start = torch.randn((valid, *shape), generator=gen, dtype=data.x.dtype).to(device)
            teacher = model_part(payload)
            student = {k[len(KEPT):]: v for k, v in client_state.items() if k.startswith(KEPT)}
            x[:valid], logits[:valid] = synthesise(self.info.model_call, teacher, student, targets.to(device),
                                                   start, self.opt)
        order = torch.randperm(max(valid, 1), generator=gen)
        pair = order[torch.arange(n) % len(order)].to(device)
        weight = (torch.arange(size, device=device) < valid).to(data.x.dtype)
        return {**client_state, SYN_X: x, SYN_T: logits, SYN_W: weight, PAIR: pair,
                W_SYN: torch.tensor(w_syn, dtype=data.x.dtype, device=device)}

    def paired_samples(self, client_state):
        if SYN_X not in client_state:
            return None, client_state
        pair = client_state[PAIR]
        rest = {k: v for k, v in client_state.items() if k not in (SYN_X, PAIR)}
        return (client_state[SYN_X][pair][:, None], pair[:, None]), rest

    def local_loss(self, fwd, params, x, y, payload, client_state):
        """FedAvg's cross-entropy; with synthetic inputs (the batch's second half, whose labels are their
        rows in the synthetic set): (1 - w_syn) CE on the own half + w_syn T^2 KL from the teacher logits."""
        _, logits = fwd(x)
        if SYN_T not in client_state:
            return fwd.cross_entropy(logits, y), {}
        b = x.shape[0] // 2
        rows = F.one_hot(y[b:], client_state[SYN_T].shape[0]).to(logits)
        teacher, valid, w_syn = rows @ client_state[SYN_T], rows @ client_state[SYN_W], client_state[W_SYN]
        real = F.cross_entropy(logits[:b], y[:b])
        syn = kd_loss(logits[b:], teacher, self.opt.temperature, "paper", mean=lambda t: (t * valid).mean())
        return (1 - w_syn) * real + w_syn * syn, {"kd": syn}

    def after_training(self, trained, payload, client_state, report):
        kept = {k: v for k, v in client_state.items() if not k.startswith((KEPT, "cog."))}
        kept.update({KEPT + k: v.detach().clone() for k, v in trained.items()})
        return {MODEL + k: v for k, v in trained.items()}, kept
