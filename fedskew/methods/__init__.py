"""Method registry: one module per method family; every method is a :class:`Method`.

Any method also takes the composable pieces of :data:`COMPONENTS` as sub-options
(``method.prototypes.mu2=1e-4``, ``method.decorrelation.mu1=0.01``, ``method.rs.alpha=0.5``,
``method.hpm.kt=kd``): the method is then wrapped in a :class:`~fedskew.methods.compose.Composite`.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from fedskew.methods.base import ClientReport, FederationInfo, Forward, Method, State
from fedskew.methods.compose import Composite
from fedskew.methods.drift import FedDC, FedDyn, FedNova, FedProx, Scaffold
from fedskew.methods.fedmr import COMPONENTS as FEDMR_COMPONENTS
from fedskew.methods.fedmr import FedMR
from fedskew.methods.map import COMPONENTS as MAP_COMPONENTS
from fedskew.methods.map import MAP, FedPHP, FedRS
from fedskew.methods.fedka import FedKA, FedNTD
from fedskew.methods.meta import PerFedAvg, PFedMe
from fedskew.methods.neural_collapse import EtfGmv
from fedskew.methods.personalized import Ditto, DittoRS, FedBABU, FedLC, FedProto, FedRep, FedROD
from fedskew.methods.representation import FedMMD, Moon, fedproc
from fedskew.methods.server_opt import FedAdam, FedAvgM, FedAwS, FedYogi

METHODS: dict[str, type[Method]] = {
    "fedavg": Method, "fedmr": FedMR, "fedprox": FedProx, "scaffold": Scaffold, "feddyn": FedDyn,
    "fednova": FedNova, "fedavgm": FedAvgM, "fedadam": FedAdam, "fedyogi": FedYogi, "fedaws": FedAwS,
    "moon": Moon, "fedmmd": FedMMD, "feddc": FedDC, "fedproc": fedproc,
    "fedrs": FedRS, "fedphp": FedPHP, "map": MAP, "etf_gmv": EtfGmv,
    "fedntd": FedNTD, "fedka": FedKA,
    "ditto": Ditto, "dittors": DittoRS, "fedrep": FedRep, "fedbabu": FedBABU, "fedrod": FedROD,
    "fedproto": FedProto, "fedlc": FedLC, "pfedme": PFedMe, "perfedavg": PerFedAvg,
}
COMPONENTS = {**FEDMR_COMPONENTS, **MAP_COMPONENTS}


def _validate(schema: type[BaseModel], data: dict, where: str, what: str) -> BaseModel:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = sorted(schema.model_fields) + (sorted(COMPONENTS) if where == "method" else [])
            raise ValueError(f"{where}.{key} is not an option of {what}; allowed: {allowed}") from None
        raise ValueError(f"{where}.{key} = {err.get('input')!r} is not allowed: {err['msg']}") from None


def _parse(cfg):
    cls = METHODS.get(cfg.name)
    if cls is None:
        raise ValueError(f"method.name '{cfg.name}' is not known; allowed: {sorted(METHODS)}")
    options = dict(cfg.options)
    parts = {}
    for name, comp in COMPONENTS.items():
        if name in options:
            sub = options.pop(name)
            if not isinstance(sub, dict):
                raise ValueError(f"method.{name} must be a mapping of options such as {{mu2: 0.0001}}, not {sub!r}")
            parts[name] = _validate(comp.Options, sub, f"method.{name}", name)
    return cls, _validate(cls.Options, options, "method", cfg.name), parts


def validate_method_config(cfg) -> None:
    _parse(cfg)


def method_model_defaults(cfg) -> dict:
    """The model options the method named by ``cfg`` uses by default (``Method.model_defaults``)."""
    return dict(getattr(METHODS[cfg.name], "model_defaults", {}))


def build_method(cfg, info: FederationInfo | None = None) -> Method:
    cls, options, parts = _parse(cfg)
    method = cls(options, info)
    if not parts:
        return method
    return Composite(method, [COMPONENTS[name](opt) for name, opt in parts.items()])


__all__ = ["ClientReport", "FederationInfo", "Forward", "METHODS", "Method", "State", "build_method",
           "method_model_defaults", "validate_method_config"]
