"""The method interface, and FedAvg (McMahan et al., 2017) as its default implementation.

A method is a handful of pure functions over explicit state (design.md, "A method is a few pure
functions"). Every executor (sequential loop, vectorised ``torch.func`` program, Flower app) calls
the same functions:

=====================  =======================================================================
``server_init``        global model state -> server state (control variates, prototypes, ...)
``client_init``        client id -> that client's persistent state (created on first selection)
``round_start``        (server state, the round's clients, round) -> the round's server state
                       (FedCross's assignment of its models to the selected clients)
``broadcast``          (global state, server state) -> payload, the flat dict sent to a client
``prepare``            (payload, client state, client data) -> client state, before training
                       (e.g. FedKA's anchor set; default: unchanged)
``local_start``        (payload, client state) -> the model state local training starts from
``local_loss``         (forward, params, x, y, payload, client state) -> (loss, aux); pure, so it
                       can run under ``vmap(grad(...))``
``after_training``     (trained state, payload, client state, report) -> (upload, client state)
``personal_state``     (trained state, client state) -> the client's personalised model
``aggregate``          (server state, global state, uploads, reports) -> (global, server state)
``step_correction``    (payload, client state) -> a direction applied after every optimizer step
                       of the uploaded model's training, outside momentum (SCAFFOLD, FedDC)
``paired_samples``     (client state) -> (samples joined to each of the client's own in its
                       batches this round, the rest of the state) (FedFed's shared features)
=====================  =======================================================================

A method may add a second local stage, whose result is the client's personalised model
(MAP/FedPHP, Ditto, FedRep's head epochs, ...): ``split_steps`` divides the local step budget
between the two stages, and ``personal_start``, ``personal_loss`` and ``after_personal`` play the
roles of ``local_start``, ``local_loss`` and ``after_training`` for the second stage. Executors run
the stages one after another on the same batch stream, with fresh SGD momentum for each; the
personalisation stage runs after the uploaded model's training, or before it when
``personal_first`` (FedRep: head epochs, then body epochs). ``trained_params(stage)`` names the
parameters a stage updates (FedRep, FedBABU, FedROD freeze parts of the model); the others keep
their values (BatchNorm statistics still update in train mode). A method without a global model
(FedProto, FedRep) sets ``has_global_model = False``: its ``global/*`` metrics are reported as
none, never as the accuracy of a model nobody uses.

Payloads, uploads and states are flat ``dict[str, Tensor]``. Model tensors travel under the
``model.`` prefix. Communication is counted by summing the sizes of payloads and uploads, so no
method can misreport it. Methods hold their options and the federation's static facts
(:class:`FederationInfo`), both immutable, and nothing else.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

State = dict[str, torch.Tensor]
MODEL = "model."


@dataclass(frozen=True)
class FederationInfo:
    """What a method may know about the federation (static for the whole run)."""

    num_clients: int
    num_classes: int
    class_counts: torch.Tensor  # clients x classes, local training samples
    rounds: int
    clients_per_round: int
    seed: int
    param_names: tuple[str, ...] = ()  # trainable tensors of the model state (the rest are buffers)
    feature_dim: int = 0  # d, the dimension of the features z the classifier reads
    # A public set of one training sample per class, drawn once from the seed (stream
    # ``public_samples``) and visible to every client (FedKA's shared anchors): (x [C, ...], y [C]).
    public_samples: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    local_epochs: int = 1  # E and B of local training (FedDC's fixed control step count)
    batch_size: int = 1
    # parameters and buffers of the model's normalisation layers (BatchNorm, GroupNorm, LayerNorm):
    # what FedBN keeps local
    norm_names: frozenset[str] = frozenset()
    # ``(state, x, train) -> (z, logits)``: the model's architecture run on a state, differentiable
    # in it (train: train mode, BatchNorm statistics of the batch, buffers not updated); for work a
    # method does outside local training: FedDF's server-side distillation, FedALA's weight learning
    model_call: Callable | None = field(default=None, compare=False, repr=False)
    # ``source -> x``: the inputs of the global ``test`` set or the pooled ``train`` set, without
    # labels, in an order drawn once from the seed; a method's public set is the first n, which it
    # declares visible to every client and the server (FedDF's distillation data)
    public_pool: Callable | None = field(default=None, compare=False, repr=False)
    # the model's fixed architecture tensors (``model.fixed_keys``: the ETF head), built from the
    # seed by every party and never sent; a personalised state may override them (FedGELA's head)
    fixed_state: dict = field(default_factory=dict, compare=False, repr=False)
    # floats in the model's trainable tensors (a method that allocates in proportion checks it first)
    param_numel: int = 0
    # ``j -> state``: a further independent initialisation of the run's model, j = 1, 2, ... (the
    # configured model drawn again from stream ``method_models``, j): IFCA's cluster models
    model_draw: Callable | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ClientData:
    """What ``Method.prepare`` may read about a selected client before its local training."""

    client_id: int
    round_idx: int
    x: torch.Tensor  # the client's local training inputs
    y: torch.Tensor
    frozen: Callable[[dict, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (state, x) -> (z, logits), eval mode
    x_val: torch.Tensor | None = None  # the client's validation split (``Method.validation_fraction``)
    y_val: torch.Tensor | None = None
    lr: float = 0.0  # the round's local learning rate
    steps: int = 0  # the client's local steps this round (both stages; fewer for a straggler)


@dataclass(frozen=True)
class ClientReport:
    """Facts about one client's local training in one round."""

    client_id: int
    num_samples: int
    num_steps: int
    lr: float = 0.0  # local SGD learning rate and momentum used this round
    momentum: float = 0.0
    # state -> (features z, labels y) of the client's whole local training set, eval mode, no
    # gradient (e.g. for class prototypes computed after training).
    local_features: Callable[[dict], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, compare=False, repr=False)
    # state -> the same state with BatchNorm running statistics recomputed over one pass of the
    # client's local training data (None: the model has no BatchNorm).
    recalibrate_bn: Callable[[dict], dict] | None = field(default=None, compare=False, repr=False)
    # () -> (x, y), the client's local training inputs and labels (FedAS's Fisher trace of the
    # trained model)
    local_data: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, compare=False, repr=False)


class Reports(list):
    """A round's :class:`ClientReport` list with the changes of FedAvg's weights that a composite's
    components make (``reweight``: (weights, reports) -> weights, in order, e.g. FedDisco's),
    passed to the base method's ``aggregate`` explicitly and applied by ``client_weights``."""

    def __init__(self, reports, reweight: tuple = ()):
        super().__init__(reports)
        self.reweight = tuple(reweight)


class Forward:
    """What ``local_loss`` may call: ``fwd(x) -> (z, logits)`` runs the model being trained
    (train mode); ``fwd.frozen(state, x)`` runs the same architecture with another state in eval
    mode and without gradient (e.g. the received global model, a teacher); ``fwd.head(h)`` runs the
    trained model's classifier alone on features ``h`` (e.g. features plus memory vectors);
    ``fwd.call(state, x)`` runs the model being trained with other parameter (and optionally
    buffer) values in train mode, differentiable in them, its own ``fwd.buffers`` filling in what
    ``state`` lacks (inner steps of pFedMe and Per-FedAvg; pass the buffers through
    ``torch.func.grad`` as an argument so BatchNorm may update them); ``fwd.evaluate(x)`` runs the
    model being trained in eval mode (a snapshot of its running BatchNorm statistics, no dropout,
    no buffer update), differentiable in its parameters (FedKA's anchors, compared with eval-mode global logits)."""

    def __init__(self, train_fn: Callable, frozen_fn: Callable, head_fn: Callable | None = None,
                 call_fn: Callable | None = None, buffers: State | None = None, eval_fn: Callable | None = None,
                 weights: torch.Tensor | None = None):
        self._train_fn = train_fn
        self._frozen_fn = frozen_fn
        self._head_fn = head_fn
        self._call_fn = call_fn
        self._eval_fn = eval_fn
        self.buffers = buffers if buffers is not None else {}
        # Per-sample weights of a padded batch (real rows 1/b, padding 0; None: no padding). Only
        # ``mean`` and ``cross_entropy`` read them, so only losses written with them may declare
        # ``per_sample_loss`` (Method.padding_exact).
        self.weights = weights

    def wrapping(self, fwd: Forward) -> None:
        """Take every function of ``fwd`` (for subclasses that wrap a Forward)."""
        Forward.__init__(self, fwd._train_fn, fwd._frozen_fn, fwd._head_fn, fwd._call_fn, fwd.buffers, fwd._eval_fn,
                         fwd.weights)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The batch mean of per-sample ``values`` (dim 0: samples; further dims are averaged
        too, as ``values.mean()`` does for equal batch sizes); padding rows weigh nothing."""
        if self.weights is None:
            return values.mean()
        return (values.reshape(values.shape[0], -1).mean(1) * self.weights).sum()

    def cross_entropy(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``F.cross_entropy(logits, y)`` over the batch's real samples."""
        if self.weights is None:
            return F.cross_entropy(logits, y)
        return (F.cross_entropy(logits, y, reduction="none") * self.weights).sum()

    def __call__(self, x: torch.Tensor):
        return self._train_fn(x)

    def frozen(self, state: State, x: torch.Tensor):
        return self._frozen_fn(state, x)

    def head(self, h: torch.Tensor):
        return self._head_fn(h)

    def call(self, state: State, x: torch.Tensor):
        return self._call_fn(state, x)

    def evaluate(self, x: torch.Tensor):
        return self._eval_fn(x)


def declares_per_sample(obj, fn: str) -> bool:
    """Whether the class that defines ``obj.<fn>`` itself sets ``per_sample_loss = True``. A
    subclass that overrides a loss without repeating the declaration is not trusted with padding."""
    for cls in type(obj).__mro__:
        if fn in cls.__dict__:
            return cls.__dict__.get("per_sample_loss", False) is True
    return False


HEAD = "classifier."  # the classifier's tensors; the body is every other parameter


def head_names(info) -> frozenset[str]:
    """The trainable tensors of the classifier (``classifier.*``)."""
    return frozenset(k for k in info.param_names if k.startswith(HEAD))


def body_names(info) -> frozenset[str]:
    return frozenset(k for k in info.param_names if not k.startswith(HEAD))


def fraction_steps(total_steps: int, fraction: float) -> int:
    """round(fraction * total), at least 1 step when fraction > 0 (a stage's share of the E-epoch budget)."""
    return max(1, round(fraction * total_steps)) if fraction > 0 else 0


def reference_tensor(state: State) -> torch.Tensor:
    """A floating-point tensor of ``state``, for the device and dtype of new state entries."""
    return next(v for v in state.values() if v.is_floating_point())


def strip_prefix(d: State, prefix: str) -> State:
    """The entries of ``d`` under ``prefix``, without it (a model kept in a client state, ...)."""
    return {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}


def add_prefix(state: State, prefix: str) -> State:
    return {prefix + k: v for k, v in state.items()}


def model_part(d: State) -> State:
    """The model tensors of a payload/upload, without the ``model.`` prefix."""
    return strip_prefix(d, MODEL)


def as_model_part(state: State) -> State:
    return add_prefix(state, MODEL)


def copies(state: State, n: int, prefix: str = "") -> State:
    """Every entry of ``state`` stacked ``n`` times along a new first dimension, under ``prefix``:
    a server's per-client (or per-slot) models all starting from one state (FedFOMO, FedAMP,
    FedPAC's heads, FedCAC's customised models, FedCross's middleware models)."""
    return {prefix + k: v[None].repeat(n, *([1] * v.dim())) for k, v in state.items()}


def weighted_mean(states: list[State], weights: torch.Tensor) -> State:
    """sum_i w_i * state_i for every key (weights must sum to 1)."""
    out = {}
    for key in states[0]:
        stacked = torch.stack([s[key].to(torch.float32) for s in states])
        w = weights.to(stacked).view(-1, *([1] * (stacked.dim() - 1)))
        out[key] = (stacked * w).sum(0).to(states[0][key].dtype)
    return out


# floats a method may allocate for one structure of its own (pFedHN's heads, FedFed's VAE) before
# anything is built: 2^30 floats = 4 GiB of float32; larger options are refused in one sentence
MAX_METHOD_FLOATS = 1 << 30


def check_size(method: str, what: str, floats: int) -> None:
    """One sentence when ``floats`` (the size of ``what``) exceeds :data:`MAX_METHOD_FLOATS`."""
    if floats > MAX_METHOD_FLOATS:
        raise ValueError(
            f"method {method}'s {what} would hold {floats:,} floats ({4 * floats / 2**30:,.1f} GiB), more "
            f"than the {MAX_METHOD_FLOATS:,} a method may allocate; choose smaller options"
        )


class StrictOptions(BaseModel):
    """Options of a method, a component or a config section: unknown keys are errors. ``renamed``
    maps an option's former name to its name now; the former name still works for one release, with
    a FutureWarning that names both."""

    # defer_build: an Options class builds its validator when it first validates, so importing the
    # registry (every method's class) stays cheap for a command that validates one of them
    model_config = ConfigDict(extra="forbid", defer_build=True)
    renamed: ClassVar[dict[str, str]] = {}
    # a few values of each option worth tuning (the default among them): what ``fedskew bench``
    # searches, the same number of trials for every method (:func:`search_space` merges a composed
    # method's components')
    search: ClassVar[dict[str, list]] = {}

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data):
        if not isinstance(data, dict) or not cls.renamed:
            return data
        data = dict(data)
        for old, new in cls.renamed.items():
            if old in data:
                if new in data:
                    raise ValueError(f"'{old}' is the former name of '{new}'; give '{new}' only")
                warnings.warn(f"option '{old}' is now called '{new}'; the old name works until fedskew 0.2.",
                              FutureWarning, stacklevel=2)
                data[new] = data.pop(old)
        return data


def search_space(options: type[BaseModel]) -> dict[str, list]:
    """The option values the bench searches for a method: the ``search`` of its Options class and of
    every class it inherits from (a composed method's components), nearest first."""
    out: dict[str, list] = {}
    for cls in options.__mro__:
        for key, values in vars(cls).get("search", {}).items():
            out.setdefault(key, list(values))
    return out


@dataclass(frozen=True)
class Source:
    """Where a method or component comes from: its paper (authors, title, venue, year, arXiv id when
    it has one), the official code it was checked against (or what stood in for it), and the
    equations or algorithm it implements. ``fedskew methods NAME`` prints it; every registered
    method and component has one (tests/test_docs.py)."""

    authors: str
    title: str
    venue: str
    year: int | None
    implements: str
    code: str
    arxiv: str | None = None

    def text(self) -> str:
        arxiv = f", arXiv {self.arxiv}" if self.arxiv else ""
        year = f" {self.year}" if self.year else ""
        return (f"{self.authors}, \"{self.title}\", {self.venue}{year}{arxiv}. Implements: {self.implements}. "
                f"Checked against: {self.code}.")


class FedAvgOptions(StrictOptions):
    weighting: Literal["samples", "batches", "uniform"] = Field(
        "samples", description="aggregation weights p_k: by local samples n_k (McMahan et al.), by local batches, "
                               "or equal")


BUILTIN_METHODS: dict[str, type] = {}  # name -> class, filled where each built-in method is defined


def builtin(cls: type) -> type:
    """Register a built-in method class under its ``name`` where it is defined (the registry,
    ``fedskew.algorithms.METHODS``, collects every module of the package)."""
    name = cls.__dict__["name"]
    if name in BUILTIN_METHODS:
        raise ValueError(f"built-in method name '{name}' is defined twice ({BUILTIN_METHODS[name].__qualname__}, "
                         f"{cls.__qualname__})")
    BUILTIN_METHODS[name] = cls
    return cls


@builtin
class Method:
    """FedAvg: every selected client trains the received global model for E local epochs of SGD,
    and the server averages the uploaded models weighted by the clients' sample counts.

    The base of every method: a subclass overrides the pieces it changes (docs/design.md)."""

    name = "fedavg"
    Options: type[BaseModel] = FedAvgOptions
    # the paper, official code and equations: every registered class sets its own (tests/test_docs.py)
    source: Source | None = Source(
        authors="McMahan et al.",
        title="Communication-Efficient Learning of Deep Networks from Decentralized Data",
        venue="AISTATS",
        year=2017,
        arxiv="1602.05629",
        implements="Algorithm 1 (FederatedAveraging: E local epochs of minibatch SGD, the n_k-weighted average)",
        code="no official code; the paper's Algorithm 1")
    # "linear": the method trains or edits the classifier (refuses model.classifier=etf);
    # "etf": the method needs the fixed ETF head; None: either.
    requires_classifier: str | None = None
    has_global_model = True  # False: no model serves the global test set (FedProto, FedRep)
    # model options this method's papers use, applied to the keys a config leaves unset
    # (``method=map`` -> a bias-free classifier; ``method=etf_gmv`` -> the fixed ETF head)
    model_defaults: dict = {}
    # local-training settings (RUN_DEFAULT_KEYS) the method's official code uses, applied where a
    # config leaves them unset (pFedHN: the authors' inner lr 5e-3, weight decay 5e-5, clip 50)
    run_defaults: dict = {}
    # True: the client's local optimiser is part of the method (FedCM's and GHBM's client momentum
    # replaces SGD's): a benchmark's common optimiser keeps the lr and momentum of ``run_defaults``
    own_optimiser = False
    personal_first = False  # True: the personalisation stage runs before the uploaded model's training
    # The losses below are batch means of per-sample terms, written with ``fwd.mean`` and
    # ``fwd.cross_entropy`` (plus terms of the parameters alone): see ``padding_exact``.
    per_sample_loss = True
    # parameters the built model must have (True) or lack (False), with what gives them: when a
    # config overrode the option the method's defaults set, ``__init__`` says so in one sentence
    model_requires: dict[str, tuple[bool, str]] = {}
    # False: ``aggregate`` does not weigh the clients by ``client_weights`` (SCAFFOLD's and FedDyn's
    # uniform mean, FedNova's, FedProto's per-class counts, ...): a component that reweights the
    # FedAvg weights (``method.disco``) refuses it. tests/test_health.py checks every declaration.
    fedavg_weighted = True
    # sharpness-aware local steps (Component ``sam``: its options rho, adaptive, eta), read by the
    # executors for the uploaded model's training; None: plain SGD. An object with ``ascent`` (a loss
    # of local_loss's signature) takes eps from that loss's gradient by its ``perturbation(params,
    # grads, payload)`` instead (FedSOL), every tensor with a leading client dimension
    sam = None
    # False: the vectorised executor trains this method one client after another (randomness inside
    # the loss that vmap cannot draw as the sequential executor does: FedCP's Gumbel noise)
    vectorizable = True

    def __init__(self, options: BaseModel | None = None, info: FederationInfo | None = None):
        self.opt = options if options is not None else self.Options()
        self.info = info  # static facts of the federation (numbers of clients, parameter names)
        for name, (present, what) in self.model_requires.items():
            if info is not None and info.param_names and (name in info.param_names) != present:
                raise ValueError(f"method {self.name} needs {what}.")

    # -- state ---------------------------------------------------------------------------------
    def server_init(self, global_state: State, info: FederationInfo) -> State:
        return {}

    def client_init(self, client_id: int, global_state: State, info: FederationInfo) -> State:
        return {}

    # -- down ----------------------------------------------------------------------------------
    def broadcast(self, global_state: State, server_state: State) -> State:
        return as_model_part(global_state)

    # True: ``build_model`` takes ``num_clients`` too (an architecture with a part per client: APPLE's
    # mixing weights over every client's core model)
    sized_by_clients = False

    @classmethod
    def build_model(cls, model: nn.Module, options: BaseModel, rebuild: Callable[[], nn.Module]) -> nn.Module:
        """The method's own architecture around the configured model (the ``model`` section's,
        built by :func:`fedskew.models.build_model`): FLDA's private expert, FedDBE's shift, GPFL's
        valve, FedCP's policy, FedConcat's branches. ``rebuild()`` draws another model of the same
        configuration (the next draws of the run's model-init stream). Identity by default."""
        return model

    @classmethod
    def inert(cls, options: BaseModel, rounds: int, num_clients: int, clients_per_round: int) -> str | None:
        """What an option switches off for a whole run of ``rounds`` rounds (GHBM's ``tau`` past the
        run: no momentum ever), as a sentence naming it, which the config layer prints as a warning
        when the run starts; None: every part of the method acts. FedAvg: None."""
        return None

    @classmethod
    def validation_fraction(cls, options: BaseModel) -> float:
        """Share of every client's training data held out as its local validation split (never
        trained on; ``ClientData.x_val``) for a method with these options. FedAvg: 0."""
        return 0.0

    def class_role_threshold(self, num_classes: int) -> float:
        """gamma of the class roles that ``forgetting_stats`` reports (FedKA, Chen et al. 2023, Sec. 3,
        Eq. 1): a class with less than this share of a client's samples is non-dominant there. 1 / C
        unless the method sets its own (FedKA's ``gamma``)."""
        return 1.0 / num_classes

    def round_start(self, server_state: State, clients: list[int], round_idx: int) -> State:
        """The server state of a training round, given the clients selected for it (sorted), before
        anything is sent: what a method decides per round from who takes part (FedCross: which of
        its models each client trains). Not called for the final personalisation pass. Default:
        ``server_state``."""
        return server_state

    def download(self, server_state: State, client_id: int, round_idx: int) -> State:
        """Entries sent to one selected client only (FedFOMO's chosen models), merged into its
        client state for this round and counted as downloaded; the method's ``after_training``
        must drop them from the state it keeps. Default: nothing (every client gets ``broadcast``)."""
        return {}

    def paired_samples(self, client_state: State) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, State]:
        """Samples that travel with the client's own training samples this round, taken out of the
        prepared client state: ``((x [n, m, ...], y [n, m]), the rest of the state)``, row i paired
        with the client's own sample i (FedFed's shared features). A batch of b own samples then
        trains as b (1 + m) samples: the own first, then each of the m slots in turn (the official
        FedFed loader's ``cat(x1, x2, x3)``), each paired sample cropped and flipped as its own
        sample is when augmentation is on. Called by every executor after ``prepare``, outside
        ``vmap``; the rest of the state is what local training and ``after_training`` receive.
        Default: ``(None, client_state)``."""
        return None, client_state

    def prepare(self, payload: State, client_state: State, data: ClientData) -> State:
        """The client state local training uses, built from the client's data before training
        (outside ``vmap``; the result must have the same keys and shapes for every client)."""
        return client_state

    def local_start(self, payload: State, client_state: State) -> State:
        return model_part(payload)

    # -- local ---------------------------------------------------------------------------------
    def local_loss(self, fwd: Forward, params: State, x: torch.Tensor, y: torch.Tensor,
                   payload: State, client_state: State) -> tuple[torch.Tensor, State]:
        """Cross-entropy of the local model on the batch (FedAvg's local objective)."""
        _, logits = fwd(x)
        return fwd.cross_entropy(logits, y), {}

    def padding_exact(self, stage: Literal["upload", "personal"]) -> bool:
        """Whether the stage's loss is a batch mean of per-sample terms (plus terms that do not
        depend on the batch), computed with ``fwd.mean`` / ``fwd.cross_entropy``, so that the
        vectorised executor may pad the clients of a step to one batch size with zero-weight rows
        and train them in one call. True when the class that defines the stage's loss declares
        ``per_sample_loss = True``; a loss that reads batch statistics (FedMR's intra-class
        standardisation, prototype means, MMD, inner steps on batch halves) must not declare it.
        BatchNorm models are never padded (the executor checks the model)."""
        return declares_per_sample(self, "local_loss" if stage == "upload" else "personal_loss")

    def after_training(self, trained: State, payload: State, client_state: State,
                       report: ClientReport) -> tuple[State, State]:
        return as_model_part(trained), client_state

    def personal_state(self, trained: State, client_state: State) -> State:
        """The client's personalised model after this round (FedAvg: the locally trained model;
        FedPHP: its inherited private model). Scored as ``personal/acc_after``."""
        return trained

    def local_steps(self, round_idx: int, total_steps: int, steps_per_epoch: int) -> int:
        """The client's step budget in round ``round_idx`` (0-based), given its E-epoch budget
        ``total_steps`` and its mini-batches per epoch; a method whose rounds differ by phase says
        so here (FedConcat: a few classifier steps per round after its encoder rounds). FedAvg:
        ``total_steps``."""
        return total_steps

    def lr_scale(self, round_idx: int) -> float:
        """A factor on the run's local learning rate of round ``round_idx`` (``RunConfig.round_lr``;
        ``round_idx = rounds``: the final pass), for a method whose official schedule is part of
        the method (FedExP's 0.998 decay per round). FedAvg: 1."""
        return 1.0

    # -- optional second local stage (personalisation) -------------------------------------------
    def split_steps(self, total_steps: int, lr: float) -> tuple[int, int, float]:
        """(steps of the uploaded model's training, steps of the personalisation stage, learning
        rate of the personalisation stage) for a client whose E local epochs are ``total_steps``
        mini-batches at learning rate ``lr``. FedAvg: all steps, no second stage."""
        return total_steps, 0, lr

    def trained_params(self, stage: Literal["upload", "personal"]) -> frozenset[str] | None:
        """The parameter names a local stage updates; None: all of them."""
        return None

    def step_correction(self, payload: State, client_state: State) -> State | None:
        """A per-parameter direction d that every executor applies after each optimizer step of
        the uploaded model's training, outside momentum, weight decay and clipping:
        ``p <- p - lr * d`` (SCAFFOLD's c - c_i, as NIID-Bench applies it). Pure (it is vmapped
        over clients); None: no correction. FedAvg: None."""
        return None

    def personal_start(self, trained: State, payload: State, client_state: State) -> State:
        """The state the personalisation stage starts from (default: ``trained``, the uploaded
        model; with ``personal_first``, ``trained`` is the round's ``local_start`` state)."""
        return trained

    def personal_loss(self, fwd: Forward, params: State, x: torch.Tensor, y: torch.Tensor,
                      payload: State, client_state: State) -> tuple[torch.Tensor, State]:
        _, logits = fwd(x)
        return fwd.cross_entropy(logits, y), {}

    def after_personal(self, personal: State, payload: State, client_state: State,
                       report: ClientReport) -> State:
        """The client state after the personalisation stage produced ``personal``."""
        return client_state

    # -- up ------------------------------------------------------------------------------------
    def client_weights(self, reports: list[ClientReport]) -> torch.Tensor:
        """FedAvg weights p_k: by samples n_k (default), by local batches, or uniform; then the
        reweighting that came with the reports (:class:`Reports`, a component's such as FedDisco's)."""
        if self.opt.weighting == "samples":
            w = torch.tensor([r.num_samples for r in reports], dtype=torch.float64)
        elif self.opt.weighting == "batches":
            w = torch.tensor([r.num_steps for r in reports], dtype=torch.float64)
        else:
            w = torch.ones(len(reports), dtype=torch.float64)
        w = w / w.sum()
        for reweight in getattr(reports, "reweight", ()):
            w = reweight(w, reports)
        return w

    def evaluation_state(self, global_state: State, server_state: State) -> State:
        """The global model a round's metrics score (and a run's result holds), given the new
        global model and server state; the next round still starts from ``global_state``. Default:
        the global model itself (FedExP: the mean of the last two)."""
        return global_state

    def aggregate(self, server_state: State, global_state: State, uploads: list[State],
                  reports: list[ClientReport]) -> tuple[State, State]:
        """theta <- sum_k p_k theta_k over the selected clients, BatchNorm buffers included."""
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return new, server_state
