"""Composable method pieces (design.md, "One way to compose").

A :class:`Component` adds to a base method: extra server/client state, extra payload and upload
entries under its own prefix, an extra loss term, and its own aggregation of its uploads. A
:class:`Composite` is a base method plus components: losses add up, payloads and uploads merge.
This is how FedMR is FedAvg + intra-class decorrelation + prototype margin, and how any method
takes prototypes by configuration (``method.prototypes.mu2=1e-4``).

All components of one composite see the same forward pass of a batch (:class:`SharedForward`), so
BatchNorm statistics are updated once per step, as in the sequential reference.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from pydantic import BaseModel

from fedskew.algorithms.base import (
    ClientReport,
    FederationInfo,
    Forward,
    Method,
    Reports,
    State,
    add_prefix,
    as_model_part,
    declares_per_sample,
    model_part,
    strip_prefix,
    weighted_mean,
)


class SharedForward(Forward):
    """A Forward whose training pass runs once per batch: later calls with the same ``x`` return
    the first call's outputs."""

    def __init__(self, fwd: Forward):
        self.wrapping(fwd)
        self._inner = fwd  # called as is, so wrappers (restricted logits) apply
        self._last: tuple[torch.Tensor, tuple] | None = None

    def __call__(self, x: torch.Tensor):
        if self._last is None or self._last[0] is not x:
            self._last = (x, self._inner(x))
        return self._last[1]


class Component:
    """One composable piece. Entries it sends and keeps are prefixed with ``prefix``.

    A component that sets ``personalizes = True`` owns the method's personalisation stage
    (``split_steps`` ... ``personal_state``, see :class:`~fedskew.algorithms.base.Method`); a
    composite takes at most one such component."""

    prefix = ""
    Options: type[BaseModel]
    source = None  # a base.Source: the paper, official code and equations (set on every registered component)
    personalizes = False
    personal_first = False
    per_sample_loss = True  # no loss term, logits as they are (Method.padding_exact)
    sharpness_aware = False  # True: ``opt`` holds rho, adaptive, eta of SAM local steps (Method.sam)

    def __init__(self, options: BaseModel):
        self.opt = options

    def server_init(self, global_state: State, info: FederationInfo) -> State:
        return {}

    def client_init(self, client_id: int, global_state: State, info: FederationInfo) -> State:
        return {}

    def broadcast(self, server_state: State) -> State:
        return {}

    def prepare(self, payload: State, client_state: State, data) -> State:
        return client_state

    def trained_params(self, stage: str) -> frozenset[str] | None:
        return None

    def padding_exact(self, stage: str) -> bool:
        """As :meth:`Method.padding_exact`, for this component's loss term and forward wrapper
        (upload) or its personalisation loss."""
        if stage == "personal":
            return declares_per_sample(self, "personal_loss")
        return declares_per_sample(self, "loss") and declares_per_sample(self, "wrap_forward")

    def wrap_forward(self, fwd: Forward, client_state: State) -> Forward:
        """The forward the uploaded model's training sees (e.g. restricted logits). Default: as is."""
        return fwd

    def loss(self, fwd: Forward, params: State, x: torch.Tensor, y: torch.Tensor, payload: State,
             client_state: State) -> tuple[torch.Tensor | None, State]:
        """The weighted extra loss term (None: none) and aux values to log."""
        return None, {}

    def after_training(self, trained: State, payload: State, client_state: State,
                       report: ClientReport) -> tuple[State, State]:
        return {}, client_state

    def aggregate(self, server_state: State, uploads: list[State], reports: list[ClientReport]) -> State:
        return server_state

    def reweight(self, server_state: State, weights: torch.Tensor, reports: list[ClientReport]) -> torch.Tensor:
        """The base method's FedAvg weights p_k (float64, summing to 1) changed by this component
        (FedDisco). Default: as they are; a component that overrides this needs a base method that
        aggregates with them (``Method.fedavg_weighted``)."""
        return weights


def _own(d: State, prefix: str) -> State:
    return {k: v for k, v in d.items() if k.startswith(prefix)}


def _others(d: State, prefixes: list[str]) -> State:
    return {k: v for k, v in d.items() if not any(k.startswith(p) for p in prefixes)}


# How a Composite folds each part of the method interface: a part of Method missing here is an error
# at import, so a new hook or flag is given its rule where it is added.
FOLD = {
    # state and payload dicts merge: the base's entries, then each component's own (its prefix)
    **dict.fromkeys(("server_init", "client_init", "broadcast", "prepare", "after_training", "aggregate"), "merge"),
    "local_loss": "sum",  # the base's loss plus each component's term
    "padding_exact": "all",  # exact under padding when the base and every component are
    "sam": "one",  # at most one sharpness-aware part (the base's or a component's)
    # the personalisation stage has one owner: the component that personalises, else the base
    **dict.fromkeys(
        (
            "split_steps",
            "trained_params",
            "personal_start",
            "personal_loss",
            "after_personal",
            "personal_state",
            "personal_first",
        ),
        "personal",
    ),
    # the rest is the base's (forwarded below where Composite does not filter the client state)
    **dict.fromkeys(
        (
            "round_start",
            "download",
            "local_start",
            "step_correction",
            "local_steps",
            "lr_scale",
            "paired_samples",
            "client_weights",
            "class_role_threshold",
            "evaluation_state",
            "has_global_model",
            "requires_classifier",
            "fedavg_weighted",
            "per_sample_loss",
            "vectorizable",
        ),
        "base",
    ),
    # read from the registered class by the config layer, never from an instance
    **dict.fromkeys(
        (
            "Options",
            "name",
            "source",
            "model_defaults",
            "model_requires",
            "build_model",
            "sized_by_clients",
            "run_defaults",
            "own_optimiser",
            "validation_fraction",
            "inert",
        ),
        "class",
    ),
}
_unruled = sorted(n for n in vars(Method) if not n.startswith("_") and n not in FOLD)
if _unruled:
    raise TypeError(f"compose.FOLD gives no rule for Method.{_unruled[0]}: say how a Composite folds it")


class Composite(Method):
    """A base method plus components. Subclasses set ``base`` and ``components`` in ``__init__``;
    each part of the interface folds by its rule in :data:`FOLD`."""

    def __init__(self, base: Method, components: list[Component], name: str | None = None):
        self.base = base
        self.components = components
        self.opt = base.opt
        self.info = base.info
        self.name = name or "+".join([base.name, *(c.prefix.rstrip(".") for c in components)])
        self._prefixes = [c.prefix for c in components]
        owners = [c for c in components if c.personalizes]
        base_owns = (base._personal is not None if isinstance(base, Composite)
                     else type(base).split_steps is not Method.split_steps)
        if base_owns:
            owners = [base, *owners]
        if len(owners) > 1:
            raise ValueError(f"method {self.name} combines {len(owners)} personalisation components "
                             f"({', '.join(getattr(c, 'prefix', '').rstrip('.') or c.name for c in owners)}); "
                             f"at most one is allowed.")
        self._personal = next((c for c in components if c.personalizes), None)
        self.personal_first = (self._personal or base).personal_first
        self._leaf = base
        while isinstance(self._leaf, Composite):
            self._leaf = self._leaf.base
        self._reweighting = [c for c in components if type(c).reweight is not Component.reweight]
        if self._reweighting and not self._leaf.fedavg_weighted:
            raise ValueError(
                f"method.{self._reweighting[0].prefix.rstrip('.')} reweights FedAvg's aggregation weights, "
                f"but method {base.name} does not aggregate with them (its own weighting); use it "
                f"with a method that does, such as fedavg, fedprox or moon"
            )
        sam = [c.opt for c in components if c.sharpness_aware] + ([base.sam] if base.sam is not None else [])
        if len(sam) > 1:
            raise ValueError(f"method {self.name} takes sharpness-aware local steps twice (method.sam on a method "
                             f"that already has them); set its own rho/adaptive/eta instead")
        self.sam = sam[0] if sam else None

    def server_init(self, global_state, info):
        state = self.base.server_init(global_state, info)
        for c in self.components:
            state.update(c.server_init(global_state, info))
        return state

    def client_init(self, client_id, global_state, info):
        state = self.base.client_init(client_id, global_state, info)
        for c in self.components:
            state.update(c.client_init(client_id, global_state, info))
        return state

    def broadcast(self, global_state, server_state):
        payload = self.base.broadcast(global_state, _others(server_state, self._prefixes))
        for c in self.components:
            payload.update(c.broadcast(_own(server_state, c.prefix)))
        return payload

    def round_start(self, server_state, clients, round_idx):
        return {**server_state, **self.base.round_start(_others(server_state, self._prefixes), clients, round_idx)}

    def download(self, server_state, client_id, round_idx):
        return self.base.download(_others(server_state, self._prefixes), client_id, round_idx)

    def prepare(self, payload, client_state, data):
        state = dict(self.base.prepare(payload, _others(client_state, self._prefixes), data))
        for c in self.components:
            state.update(c.prepare(payload, _own(client_state, c.prefix), data))
        return state

    def local_start(self, payload, client_state):
        return self.base.local_start(payload, _others(client_state, self._prefixes))

    def local_loss(self, fwd, params, x, y, payload, client_state):
        for c in self.components:
            fwd = c.wrap_forward(fwd, _own(client_state, c.prefix))
        fwd = SharedForward(fwd)
        loss, aux = self.base.local_loss(fwd, params, x, y, payload, _others(client_state, self._prefixes))
        aux = dict(aux)
        for c in self.components:
            term, extra = c.loss(fwd, params, x, y, payload, _own(client_state, c.prefix))
            if term is not None:
                loss = loss + term
            aux.update(extra)
        return loss, aux

    def padding_exact(self, stage):
        if stage == "personal":
            return (self._personal or self.base).padding_exact("personal")
        return self.base.padding_exact("upload") and all(c.padding_exact("upload") for c in self.components)

    def step_correction(self, payload, client_state):
        return self.base.step_correction(payload, _others(client_state, self._prefixes))

    def after_training(self, trained, payload, client_state, report):
        upload, new_state = self.base.after_training(trained, payload, _others(client_state, self._prefixes), report)
        upload, new_state = dict(upload), dict(new_state)
        for c in self.components:
            up, st = c.after_training(trained, payload, _own(client_state, c.prefix), report)
            upload.update(up)
            new_state.update(st)
        return upload, new_state

    def local_steps(self, round_idx, total_steps, steps_per_epoch):
        return self.base.local_steps(round_idx, total_steps, steps_per_epoch)

    def paired_samples(self, client_state):
        own = {k: v for k, v in client_state.items() if k not in _others(client_state, self._prefixes)}
        pairs, rest = self.base.paired_samples(_others(client_state, self._prefixes))
        return pairs, {**rest, **own}

    # The personalisation stage belongs to the one component that personalises, else to the base.
    def split_steps(self, total_steps, lr):
        return (self._personal or self.base).split_steps(total_steps, lr)

    def trained_params(self, stage):
        owner = self._personal if stage == "personal" and self._personal else self.base
        return owner.trained_params(stage)

    def personal_start(self, trained, payload, client_state):
        if self._personal:
            return self._personal.personal_start(trained, payload, _own(client_state, self._personal.prefix))
        return self.base.personal_start(trained, payload, _others(client_state, self._prefixes))

    def personal_loss(self, fwd, params, x, y, payload, client_state):
        if self._personal:
            return self._personal.personal_loss(fwd, params, x, y, payload,
                                                _own(client_state, self._personal.prefix))
        return self.base.personal_loss(fwd, params, x, y, payload, _others(client_state, self._prefixes))

    def after_personal(self, personal, payload, client_state, report):
        if self._personal:
            own = self._personal.after_personal(personal, payload, _own(client_state, self._personal.prefix), report)
            return {**client_state, **own}
        base = self.base.after_personal(personal, payload, _others(client_state, self._prefixes), report)
        return {**client_state, **base}

    def personal_state(self, trained, client_state):
        if self._personal:
            return self._personal.personal_state(trained, _own(client_state, self._personal.prefix))
        return self.base.personal_state(trained, _others(client_state, self._prefixes))

    def aggregate(self, server_state, global_state, uploads, reports):
        base_uploads = [_others(u, self._prefixes) for u in uploads]
        reweight = tuple((lambda w, r, c=c: c.reweight(_own(server_state, c.prefix), w, r)) for c in self._reweighting)
        base_reports = Reports(reports, getattr(reports, "reweight", ()) + reweight) if reweight else reports
        new_global, base_state = self.base.aggregate(_others(server_state, self._prefixes), global_state,
                                                     base_uploads, base_reports)
        new_state = dict(base_state)
        for c in self.components:
            new_state.update(c.aggregate(_own(server_state, c.prefix), [_own(u, c.prefix) for u in uploads], reports))
        return new_global, new_state


def _forward(name: str):
    """The base's ``name``: a hook called on it, or a flag read from it."""
    if callable(getattr(Method, name)):
        return lambda self, *args, **kwargs: getattr(self.base, name)(*args, **kwargs)
    return property(lambda self: getattr(self.base, name))


for _name, _rule in FOLD.items():
    if _rule == "base" and _name not in vars(Composite):
        setattr(Composite, _name, _forward(_name))


def option_holders(method: Method, path: str = "method") -> list[tuple[str, object]]:
    """Every object of ``method`` whose hooks read options from its ``opt``, by path: the method,
    and a composite's base (recursively) and components."""
    out = [(path, method)]
    if isinstance(method, Composite):
        out += option_holders(method.base, f"{path}.base")
        out += [(f"{path}.components.{i}", c) for i, c in enumerate(method.components)]
    return out


class OptionsView:
    """Options with some values replaced (a pack's per-lane values, tensors under ``vmap``)."""

    def __init__(self, options: BaseModel, values: dict):
        self.__dict__.update(_options=options, _values=values)

    def __getattr__(self, name):
        values = self.__dict__["_values"]
        return values[name] if name in values else getattr(self.__dict__["_options"], name)


@contextmanager
def lane_options(method: Method, values: dict[str, dict]):
    """Within the block, the option holders of ``method`` (:func:`option_holders`) named in
    ``values`` read those values (path -> {option: value}) instead of their own."""
    holders = dict(option_holders(method))
    saved = {path: holders[path].opt for path in values}
    try:
        for path, v in values.items():
            holders[path].opt = OptionsView(saved[path], v)
        yield
    finally:
        for path, opt in saved.items():
            holders[path].opt = opt


def options_of(schema: type[BaseModel], opt: BaseModel) -> BaseModel:
    """``schema``'s options taken by name from a named method's options (``Composed.parts``): an
    option has one name in the method and in the component it configures."""
    # validated already as the method's options; constructed, so that only what the user set
    # counts as set (a validator reading ``model_fields_set`` sees the same in both)
    return schema.model_construct(_fields_set=opt.model_fields_set & set(schema.model_fields),
                                  **{k: getattr(opt, k) for k in schema.model_fields if k in type(opt).model_fields})


class Composed(Composite):
    """The one form of a named method built by composition: a base method class (``base_method``,
    FedAvg by default) plus the components ``parts(opt)`` makes, both configured from the method's
    own ``Options`` by option name (:func:`options_of`). FedMR = FedAvg + decorrelation +
    prototypes; MAP = FedAvg + rs + hpm; DittoRS = Ditto + rs; FedProc = its loss + prototypes.
    The registry holds these classes like any other method."""

    base_method: type[Method] = Method

    def __init__(self, options: BaseModel | None = None, info: FederationInfo | None = None):
        opt = options if options is not None else self.Options()
        base = self.base_method(options_of(self.base_method.Options, opt), info)
        super().__init__(base, self.parts(opt), name=self.name)
        self.opt = opt

    def parts(self, opt) -> list[Component]:
        raise NotImplementedError


class PartialSharing(Method):
    """A model of which the clients share only the tensors ``shared(key)`` says; each keeps the
    rest across rounds under ``keep`` (initialised from the first global model) and trains the
    whole model every round, starting from the received shared tensors and its own kept ones.
    Down and up: the shared tensors; the server averages them (FedAvg weights) and keeps its
    other tensors as they were. Personalised model: the locally trained model."""

    keep = "local."

    def shared(self, key: str) -> bool:
        raise NotImplementedError

    def client_init(self, client_id, global_state, info):
        return add_prefix({k: v.clone() for k, v in global_state.items() if not self.shared(k)}, self.keep)

    def broadcast(self, global_state, server_state):
        return as_model_part({k: v for k, v in global_state.items() if self.shared(k)})

    def local_start(self, payload, client_state):
        return {**model_part(payload), **strip_prefix(client_state, self.keep)}

    def after_training(self, trained, payload, client_state, report):
        upload = as_model_part({k: v for k, v in trained.items() if self.shared(k)})
        return upload, add_prefix({k: v for k, v in trained.items() if not self.shared(k)}, self.keep)

    def aggregate(self, server_state, global_state, uploads, reports):
        new = weighted_mean([model_part(u) for u in uploads], self.client_weights(reports))
        return {**global_state, **new}, server_state
