"""Method registry: one module per method (``fedskew.algorithms.methods.<name>``), grouped by family
(the class's ``family``; the pieces a family's methods share are in ``fedskew.algorithms.<family>``);
every method is a :class:`Method`.

Methods added from outside the package (:func:`register_method`, ``fedskew.register_method``) join
the same table, so every executor, sweep and report runs them; ``fedskew.methods()`` returns it.
Every entry is a class: a method composed of a base method and components is a
:class:`~fedskew.algorithms.compose.Composed` subclass.

Any method also takes the composable pieces of :data:`COMPONENTS` as sub-options
(``method.prototypes.mu2=1e-4``, ``method.decorrelation.mu1=0.01``, ``method.rs.alpha=0.5``,
``method.hpm.kt=kd``): the method is then wrapped in a :class:`~fedskew.algorithms.compose.Composite`.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from fedskew.algorithms import base as _base
from fedskew.algorithms.base import ClientReport, FederationInfo, Forward, Method, State, search_space
from fedskew.algorithms.components import COMPONENTS
from fedskew.algorithms.compose import Composite

# every module of the package: the methods package registers each method where its module defines it
# (@builtin), in the order fedskew.algorithms.methods.ORDER gives
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

METHODS: dict[str, type[Method]] = dict(_base.BUILTIN_METHODS)  # FedAvg first, then by family module
BUILTIN = frozenset(METHODS)
_BUILTIN_CLASSES = tuple(METHODS.values())


def family_of(cls: type) -> str:
    """A method's family: the ``family`` its class names itself (a built-in method's module is its own), else
    its module's last part (``base`` for FedAvg, a user's module for theirs)."""
    return cls.__dict__.get("family") or cls.__module__.rsplit(".", 1)[-1]


def source_file(cls: type) -> str | None:
    """The one source file of a built-in method, relative to the repository (``src/fedskew/...``)."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if not path or not cls.__module__.startswith("fedskew."):
        return None
    return "src/" + str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1].parent)).replace("\\", "/")


def registered() -> dict[str, type[Method]]:
    """Every method a config can name (``method.name``), built-in and registered, by name."""
    return dict(METHODS)


def register_method(cls: type[Method] | None = None, *, name: str | None = None):
    """Add a :class:`Method` subclass to the registry under ``name`` (default: the class's own
    ``name`` attribute, else its lower-cased class name); returns the class, so it also works as
    a decorator (``@register_method`` or ``@register_method(name="mine")``). Registering a name
    again from the same place replaces the earlier user method (re-running a notebook cell); from
    another module or class it is refused, naming both; built-in names are taken.

    Sweeps with ``jobs > 1`` import the class's module in every worker: define the class in an
    importable module, or in a script that runs the sweep under ``if __name__ == "__main__":``."""
    def add(cls):
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register_method needs a subclass of fedskew.Method, not {cls!r}")
        key = name or cls.__dict__.get("name") or cls.__name__.lower()
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", key):
            raise ValueError(f"method name {key!r} is not allowed: use letters, digits, '_', '-' and '.'")
        if key in BUILTIN and METHODS[key] is not cls:
            raise ValueError(f"method name '{key}' is a built-in method; give yours another name "
                             f"(register_method(cls, name=...) or a class attribute name = '...')")
        old = METHODS.get(key)
        # (a notebook cell run again: the same place; a built-in class put there as a stand-in: replaced)
        if old is not None and old is not cls and old not in _BUILTIN_CLASSES and _where(old) != _where(cls):
            raise ValueError(f"method name '{key}' is registered twice: by {'.'.join(_where(old))} and by "
                             f"{'.'.join(_where(cls))}; give one of them another name")
        if not issubclass(cls.Options, BaseModel):
            raise TypeError(f"{cls.__name__}.Options must be a pydantic model (e.g. a subclass of FedAvgOptions)")
        if cls not in _BUILTIN_CLASSES:
            cls.name = key  # Composite names and messages use it
        METHODS[key] = cls
        return cls
    return add if cls is None else add(cls)


def _where(cls: type) -> tuple[str, str]:
    """Where a class is defined: (module, qualified name), a sweep worker's ``__mp_main__`` read as
    the ``__main__`` it re-imports."""
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return module, cls.__qualname__


def method_source(name: str) -> dict | None:
    """Where the user's method ``name`` is defined: its module and source file (None for a built-in
    method, or a class without a file: a notebook's); recorded in a run's run.json."""
    import inspect

    cls = METHODS.get(name)
    if cls is None or name in BUILTIN:
        return None
    try:
        path = inspect.getsourcefile(cls)
    except (OSError, TypeError):
        return None
    if not path or not Path(path).is_file():
        return None
    import hashlib

    # the file's digest: what the run was started with (a resume names the file; it never imports it)
    return {"module": _where(cls)[0], "file": str(Path(path).resolve()),
            "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def import_module_of(where: str):
    """Import a module by name (the current folder on the path) or a ``.py`` file by its stem from
    its folder (so that sweep workers import it by name too): ``--import`` and a resume of a run of
    the user's method. Raises what the import raises."""
    if where.endswith(".py"):
        folder, where = str(Path(where).resolve().parent), Path(where).stem
    else:
        folder = str(Path.cwd())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(where)


def method_code(name: str) -> str | None:
    """A digest of the source of the module that defines the user's method ``name`` (None for a
    built-in method, whose code is fedskew's commit, recorded per run): part of a sweep run's
    identity, so that a bench re-run after the user's method changed trains it again."""
    import hashlib
    import inspect

    if METHODS.get(name) is None or name in BUILTIN:
        return None
    source = method_source(name)
    try:  # (a class without a file, a notebook's: its own source)
        text = Path(source["file"]).read_bytes() if source else inspect.getsource(METHODS[name]).encode()
    except (OSError, TypeError):
        return None
    return hashlib.sha1(text).hexdigest()[:12]


def external_methods() -> dict[str, tuple[str, str]]:
    """The registered methods that are not built in, as ``name -> (module, qualified name)``: what a
    worker process needs to register them again (:func:`import_methods`)."""
    return {k: (cls.__module__, cls.__qualname__) for k, cls in METHODS.items() if k not in BUILTIN}


def import_methods(external: dict[str, tuple[str, str]]) -> None:
    """Register the methods of :func:`external_methods` in this process (a sweep worker). A method
    whose module this process cannot import is left out (a run that names it then fails with the
    usual unknown-method sentence); the others are not held back by it."""
    for key, (module, qualname) in external.items():
        try:
            # a spawned worker re-imports the parent's script as __mp_main__, aliased to __main__
            obj = sys.modules[module] if module in sys.modules else importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue
        register_method(obj, name=key)


def did_you_mean(value: str, options) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or an empty string."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def nearest_names(value: str, options, n: int = 3) -> str:
    """The ``n`` names of ``options`` nearest to ``value`` (difflib's ratio), for a misspelt name:
    a short list a reader can scan, not the whole registry."""
    import difflib

    names = [str(o) for o in options]
    return ", ".join(sorted(names, key=lambda o: -difflib.SequenceMatcher(None, str(value), o).ratio())[:n])


def unknown_method(value: str) -> str:
    """The sentence for a method name the registry does not hold."""
    return (f"method '{value}' is not known{did_you_mean(value, METHODS)}; the nearest names: "
            f"{nearest_names(value, METHODS)} (`fedskew methods` lists all {len(METHODS)})")


def _validate(schema: type[BaseModel], data: dict, where: str, what: str) -> BaseModel:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            options = sorted(schema.model_fields)
            hint = did_you_mean(key, options + (sorted(COMPONENTS) if where == "method" else []))
            said = f"its options: {', '.join(options) or 'none'}"
            if where == "method":  # (a component attaches to any method: method.<component>.<option>=...)
                said += (f"; or a component attached to it, as {where}.<component>.<option>=..., one of "
                         f"{', '.join(sorted(COMPONENTS))} (fedskew.algorithms.components says what each adds)")
            raise ValueError(f"{where}.{key} is not an option of {what}{hint}; {said}") from None
        if not key:  # a check across options (model_validator)
            raise ValueError(f"{where} options of {what}: {err['msg'].removeprefix('Value error, ')}") from None
        raise ValueError(f"{where}.{key} = {err.get('input')!r} is not allowed: {err['msg']}") from None


def _parse(cfg):
    cls = METHODS.get(cfg.name)
    if cls is None:
        raise ValueError(unknown_method(cfg.name).replace("method '", "method.name '", 1))
    options = dict(cfg.options)
    parts = {}
    for name, comp in COMPONENTS.items():
        if name in options:
            sub = options.pop(name)
            if not isinstance(sub, dict):
                raise ValueError(f"method.{name} must be a mapping of options such as {{mu2: 0.0001}}, not {sub!r}")
            parts[name] = _validate(comp.Options, sub, f"method.{name}", name)
    return cls, _validate(cls.Options, options, "method", cfg.name), parts


def validate_method_config(cfg) -> Method:
    """Options valid, and the method buildable with its components (one sentence if not): the
    method, built without federation facts. ``method.weighting`` is refused where the method
    never aggregates with FedAvg's weights (``Method.fedavg_weighted`` False: it would change
    nothing)."""
    method = build_method(cfg)
    if "weighting" in cfg.options and not method.fedavg_weighted:
        raise ValueError(f"method.weighting = {cfg.options['weighting']!r} changes nothing for method {cfg.name}: "
                         f"it does not aggregate with FedAvg's weights (its own rule: docs/methods.md); leave it unset")
    return method


def method_validation_fraction(cfg) -> float:
    """The share of each client's training data the method named by ``cfg`` holds out as its
    local validation split (``Method.validation_fraction``; 0 for most methods)."""
    cls, options, _ = _parse(cfg)
    return float(cls.validation_fraction(options))


def build_method_model(cfg, classifier: str, model, rebuild, num_clients: int = 0):
    """The model of a run of the method named by ``cfg``: the configured ``model`` (whose
    ``model.classifier`` is ``classifier``) with the method's own architecture
    (``Method.build_model``; ``rebuild()`` draws another configured model; a method whose
    architecture has a part per client, ``Method.sized_by_clients``, is given ``num_clients``). A
    method that needs the other classifier is refused first, in one sentence."""
    cls, options, _ = _parse(cfg)
    need = build_method(cfg).requires_classifier  # (a composed method's is its base's)
    if need not in (None, classifier):
        raise ValueError(f"method '{cfg.name}' needs model.classifier = '{need}', not '{classifier}'")
    if getattr(cls, "sized_by_clients", False):
        return cls.build_model(model, options, rebuild, num_clients=num_clients)
    return cls.build_model(model, options, rebuild)


def method_model_defaults(cfg) -> dict:
    """The model options the method named by ``cfg`` uses by default (``Method.model_defaults``)."""
    return dict(_parse(cfg)[0].model_defaults)


def method_inert(cfg, rounds: int, num_clients: int, clients_per_round: int) -> str | None:
    """What the options of the method named by ``cfg`` switch off for a whole run (``Method.inert``)."""
    cls, options, _ = _parse(cfg)
    return cls.inert(options, rounds, num_clients, clients_per_round)


def method_run_defaults(cfg) -> dict:
    """The local-training settings the method named by ``cfg`` uses by default (``Method.run_defaults``)."""
    return dict(_parse(cfg)[0].run_defaults)


def build_method(cfg, info: FederationInfo | None = None) -> Method:
    cls, options, parts = _parse(cfg)
    method = cls(options, info)
    if not parts:
        return method
    return Composite(method, [COMPONENTS[name](opt) for name, opt in parts.items()])


__all__ = [
    "ClientReport",
    "FederationInfo",
    "Forward",
    "METHODS",
    "Method",
    "State",
    "build_method",
    "build_method_model",
    "did_you_mean",
    "external_methods",
    "import_methods",
    "method_model_defaults",
    "method_run_defaults",
    "method_validation_fraction",
    "register_method",
    "registered",
    "validate_method_config",
]


def allowed_values(field, markdown: bool = True) -> str:
    """What an option accepts, from its type and constraints (``'hard' | 'soft'``, ``>= 0``, ...);
    ``markdown=False``: plain text for a terminal."""
    import typing

    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    literal = next((a for a in [ann, *args] if typing.get_origin(a) is typing.Literal), None)
    if literal is not None:
        text = (" \\| ".join(f"`{v}`" for v in typing.get_args(literal)) if markdown
                else " | ".join(str(v) for v in typing.get_args(literal)))
    else:
        base = args[0] if args else ann
        text = getattr(base, "__name__", str(base)).replace("NoneType", "none")
        bounds = []
        for m in field.metadata:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(m, attr, None) is not None:
                    bounds.append(f"{sign} {getattr(m, attr)}")
        text += f" {', '.join(bounds)}" if bounds else ""
    return text + (" or none" if type(None) in typing.get_args(ann) else "")


def plain_text(text: str) -> str:
    """A docstring's text for users: Sphinx roles (``:class:`~a.b.C```) as their names, double
    backticks as single ones."""
    import re

    text = re.sub(
        r":(?:class|func|meth|attr|data|mod|obj):`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text
    )
    return text.replace("``", "`")


def options_reference() -> str:
    """Markdown: every registered method's and component's options with their defaults, allowed
    values and meanings, from the ``Options`` classes (docs/methods.md, "Options reference", is
    this text; ``fedskew methods --markdown`` prints it)."""
    lines = []
    for kind, table in (("method", METHODS), ("component", COMPONENTS)):
        for name, cls in table.items():
            key = "method." if kind == "method" else f"method.{name}."
            lines += ["", f"### `{name}` ({kind})", ""]
            if cls.source is not None:
                lines += [f"Paper: {cls.source.text()}", ""]
            lines += ["| option | default | allowed | meaning |", "|---|---|---|---|"]
            for opt, field in cls.Options.model_fields.items():
                default = field.get_default(call_default_factory=True)
                lines.append(f"| `{key}{opt}` | `{default!r}` | {allowed_values(field)} | "
                             f"{(field.description or '').replace('|', chr(92) + '|')} |")
            space = search_space(cls.Options)
            if kind == "method":
                lines += ["", "`fedskew bench` searches: " + ", ".join(
                    [f"`{k}` in {v}" for k, v in space.items()] + ["`lr` x {1/3, 1, 3}"]) + "."]
    return "\n".join(lines[1:]) + "\n"
