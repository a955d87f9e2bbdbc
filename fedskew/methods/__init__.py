"""Method registry: one module per method family; every method is a :class:`Method`."""

from __future__ import annotations

from pydantic import ValidationError

from fedskew.methods.base import ClientReport, FederationInfo, Forward, Method, State

METHODS: dict[str, type[Method]] = {"fedavg": Method}


def _options(cfg):
    cls = METHODS.get(cfg.name)
    if cls is None:
        raise ValueError(f"method.name '{cfg.name}' is not known; allowed: {sorted(METHODS)}")
    try:
        return cls, cls.Options.model_validate(cfg.options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = sorted(cls.Options.model_fields)
            raise ValueError(f"method.{key} is not an option of {cfg.name}; allowed: {allowed}") from None
        raise ValueError(f"method.{key} = {err.get('input')!r} is not allowed: {err['msg']}") from None


def validate_method_config(cfg) -> None:
    _options(cfg)


def build_method(cfg) -> Method:
    cls, options = _options(cfg)
    return cls(options)


__all__ = ["ClientReport", "FederationInfo", "Forward", "METHODS", "Method", "State", "build_method",
           "validate_method_config"]
