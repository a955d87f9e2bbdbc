"""The run configuration: a pydantic schema, YAML files and ``key=value`` overrides.

The top-level keys ``method, dataset, partition, model, rounds, clients_per_round, local_epochs,
batch_size, lr, seed, device, out_dir`` are the public contract. ``method``, ``dataset``,
``partition`` and ``model`` take a name (``method: fedavg``) or a mapping with ``name`` and that
component's options (``partition: {name: pcdd, classes_per_client: 2}``).

Every validation problem becomes :class:`ConfigError` with one sentence per problem that names
the key, the value and what is allowed.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from fedskew import __version__
from fedskew.algorithms import did_you_mean  # noqa: F401  (also used by experiments)
from fedskew.algorithms.base import StrictOptions
from fedskew.data.partitions import PARTITIONS, partition_keys
from fedskew.data.sources import DATASETS, dataset_keys
from fedskew.models.build import MODEL_NAMES, model_keys

MAX_SEED = 2**63 - 1  # a seed is a signed 64-bit integer: torch's generators and the results store hold no more


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the value and what is allowed."""


class InertOptionWarning(UserWarning):
    """A method option that switches a part of the method off for the whole run (``Method.inert``):
    the run goes on, with this said once when it starts."""


class _Strict(StrictOptions):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _Section(_Strict):
    """A config section whose keys depend on its ``name`` (one schema per name, as a builder's
    signature): :meth:`applies` says which keys the chosen name reads. A key set that the name does
    not read is an error (``RunConfig`` checks it), and the record of a config (``model_dump``)
    holds only the keys that apply."""

    def applies(self) -> set[str]:
        raise NotImplementedError

    def unused_keys(self) -> list[str]:
        return sorted(self.model_fields_set - self.applies())

    @model_serializer(mode="wrap")
    def _only_applicable(self, handler):
        keep = self.applies()
        return {k: v for k, v in handler(self).items() if k in keep}


def _name_or_mapping(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


SYNTHETIC_MAX_BYTES = 8 * 2**30


class DatasetConfig(_Section):
    # the loaders' names (data.sources.LOADERS)
    name: Literal[DATASETS] = Field("digits", description="the data set (digits ships with scikit-learn)")
    root: str | None = Field(None, description="folder holding the files (every dataset but digits and synthetic)")
    download: bool = Field(True, description="try the usual mirrors when no local files are found")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="digits: stratified global test share")
    train_subsample: float = Field(1.0, gt=0, le=1, description="keep this stratified share of the training set")
    test_subsample: float = Field(1.0, gt=0, le=1, description="keep this stratified share of the global test set")
    num_classes: int = Field(10, ge=2, le=100_000, description="synthetic only")
    dim: int = Field(60, ge=1, description="synthetic only")
    train_per_class: int = Field(200, ge=1, description="synthetic only")
    test_per_class: int = Field(50, ge=1, description="synthetic only")
    separation: float = Field(3.0, gt=0, description="synthetic only: class-mean spread")
    validation_fraction: float = Field(0.0, ge=0, lt=1, description="hold out this stratified share of the "
                                                                    "training set as a global validation set")
    augment: bool = Field(False, description="random crop (padding 4) + horizontal flip of training batches")
    normalize: bool = Field(True, description="image data sets: per-channel mean/std normalisation (false: "
                                              "pixels / 255 only, torchvision's ToTensor, as NIID-Bench)")

    @model_validator(mode="after")
    def _synthetic_fits(self) -> DatasetConfig:
        """Bound the synthetic data set's memory before anything is allocated."""
        size = 4 * self.num_classes * (self.train_per_class + self.test_per_class) * self.dim
        if self.name == "synthetic" and size > SYNTHETIC_MAX_BYTES:
            raise ValueError(f"the synthetic data set would take {size / 2**30:.1f} GiB (num_classes x "
                             f"(train_per_class + test_per_class) x dim x 4 bytes); at most "
                             f"{SYNTHETIC_MAX_BYTES / 2**30:g} GiB is allowed")
        return self

    def applies(self) -> set[str]:
        """The keys data set ``name``'s loader reads (its signature: :func:`dataset_keys`)."""
        return {"name", "train_subsample", "test_subsample", "validation_fraction", "augment", *dataset_keys(self.name)}


class PartitionConfig(_Section):
    # the builders' names (data.partitions.PARTITIONERS)
    name: Literal[PARTITIONS] = Field("pcdd", description="the partition (how-to: partitions)")
    num_clients: int = Field(20, ge=1, description="number of clients K")
    classes_per_client: int = Field(3, ge=1, description="pcdd: y of PxCy; label_k: k of #C=k; label_count: k; "
                                                               "exdir: the classes each client draws")
    samples_per_class: int = Field(100, ge=1, description="label_count: n samples of each held class per client")
    alpha: float = Field(0.5, gt=0, allow_inf_nan=False, description="dirichlet, exdir, inner_dirichlet: concentration")
    min_size: int = Field(10, ge=1, description="dirichlet, exdir: minimum samples per client")
    size_sigma: float = Field(0.0, ge=0, description="random_classes, inner_dirichlet: LogNormal size-factor sigma")
    size_exponent: float = Field(0.0, ge=0, description="inner_dirichlet: power-law sizes, client k's weight "
                                                        "(k + 1) ** -size_exponent")
    partitioner: str | None = Field(None, description="flwr: a Flower Datasets partitioner's class name "
                                                      "(InnerDirichletPartitioner, DirichletPartitioner, ...)")
    partitioner_options: dict[str, Any] = Field(default_factory=dict, description="flwr: its parameters")
    min_classes: int = Field(2, ge=1, description="random_classes: fewest classes per client")
    shards_per_client: int = Field(2, ge=1, description="shards: s shards of sorted labels per client")
    local_test_fraction: float = Field(0.2, ge=0, lt=1, description="per-client local test hold-out")
    held_out: float = Field(0.0, ge=0, lt=1, description="the fraction of clients (drawn from the seed) that never "
                                                         "train; unseen/* scores the final model and each method's "
                                                         "personalisation on them")

    def applies(self) -> set[str]:
        """The keys partition ``name``'s builder reads (its signature: :func:`partition_keys`)."""
        return {"name", "num_clients", "local_test_fraction", "held_out", *partition_keys(self.name)}


class ModelConfig(_Section):
    # the zoo's names (models.build)
    name: Literal[MODEL_NAMES] = Field("mlp", description="the model")
    classifier_bias: bool = Field(True, description="a bias in the linear classifier")
    hidden: list[Annotated[int, Field(ge=1, le=1 << 16)]] | None = Field(
        None, description="hidden widths of mlp (default [200, 200]) and mlpnet (default [1024, 1024, 128])"
    )
    width: int = Field(32, ge=1, description="cnnbn channel width")
    dropout: float = Field(0.0, ge=0, lt=1, description="mlp: dropout after each hidden layer (drawn from each "
                                                        "client's own stream, the same in both executors)")
    projection_dim: int | None = Field(
        None, ge=1, description="add MOON's projection head (d->d->n); features = its output"
    )
    classifier: Literal["linear", "etf"] = Field("linear", description="etf: fixed simplex-ETF head, never trained")
    etf_scale: float = Field(1.0, gt=0, description="etf: beta, the head is beta * M^T")
    etf_normalize: bool = Field(False, description="etf: L2-normalise the features before the head")
    etf_projector: bool = Field(False, description="etf: a trainable linear projector d->d before the "
                                                   "normalisation and the head (FedETF)")
    etf_learn_scale: bool = Field(False, description="etf: beta is a trainable parameter starting at etf_scale "
                                                     "(FedETF's learnable temperature)")

    def applies(self) -> set[str]:
        own = model_keys(self.name)  # what its builder reads (its signature)
        etf = {"etf_scale", "etf_normalize", "etf_projector", "etf_learn_scale"} if self.classifier == "etf" else set()
        return {"name", "classifier_bias", "projection_dim", "classifier", *own, *etf}


# Model keys that switched on a method's own architecture before fedskew 0.2, and that method: the
# method builds it now (``Method.build_model``). A config that still gives one is read with a
# FutureWarning until 0.2; run ids keep the values these keys had (:func:`former_architecture_keys`).
ARCHITECTURE_KEYS = {"private_expert": "flda", "feature_shift": "feddbe", "conditional_valve": "gpfl",
                     "conditional_policy": "fedcp", "branches": "fedconcat"}


def former_architecture_keys(method: dict) -> dict[str, Any]:
    """The values :data:`ARCHITECTURE_KEYS` had in the resolved model section of a run of
    ``method`` (a resolved ``method`` section): what a run's identity hashes, so that a run
    recorded before they left keeps its id (and its checkpoints)."""
    name = method.get("name", "fedavg")
    out: dict[str, Any] = {key: owner == name for key, owner in ARCHITECTURE_KEYS.items()}
    out["branches"] = 1
    if name == "fedconcat":
        from fedskew.algorithms import METHODS

        out["branches"] = method.get("clusters", METHODS[name].Options.model_fields["clusters"].default)
    return out


def _architecture_keys(data: Any) -> Any:
    """Read the :data:`ARCHITECTURE_KEYS` of a config written before 0.2 (one sentence where one
    asks for what the method does not build)."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not set(model) & set(ARCHITECTURE_KEYS):
        return data
    method = data.get("method", "fedavg")
    method = {"name": method} if isinstance(method, str) else method if isinstance(method, dict) else {}
    former = former_architecture_keys(method)
    model = dict(model)
    for key in [k for k in ARCHITECTURE_KEYS if k in model]:
        value, owner = model.pop(key), ARCHITECTURE_KEYS[key]
        if value != former[key]:
            if method.get("name", "fedavg") != owner:
                raise ValueError(f"model.{key} = {str(value).lower()} is the architecture of method {owner}, which "
                                 f"only {owner} builds, trains and aggregates as it must; use method={owner}")
            raise ValueError(f"model.{key} = {str(value).lower()} does not describe method {owner}, which builds "
                             f"its own architecture ({key} = {str(former[key]).lower()}): drop the key")
        warnings.warn(f"model.{key} is no longer a config key (method {owner} builds its own architecture): drop it; "
                      f"fedskew reads it until 0.2.", FutureWarning, stacklevel=2)
    return {**data, "model": model}


class MethodConfig(BaseModel):
    """``name`` plus that method's own options, validated by the method's ``Options`` schema."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(_Strict):
    method: MethodConfig = Field(default_factory=MethodConfig, description="the method: a name (`fedskew methods` "
                                 "lists them) or a mapping with name and the method's options")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="the data set: a name or a mapping")
    partition: PartitionConfig = Field(default_factory=PartitionConfig, description="how the training set is "
                                       "split over clients: a name or a mapping")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model: a name or a mapping")
    rounds: int = Field(50, ge=1, le=10_000_000, description="communication rounds")
    clients_per_round: int = Field(10, ge=1, description="clients sampled each round (`all`: every client); the "
                                                         "same schedule for every method under one seed")
    local_epochs: int = Field(5, ge=1, le=10_000, description="local epochs E of each selected client")
    batch_size: int = Field(16, ge=1, le=1 << 20, description="local mini-batch size B (an epoch's last batch may "
                                                              "be smaller)")
    lr: float = Field(0.01, gt=0, description="local learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="local SGD momentum (torch.optim.SGD's)")
    weight_decay: float = Field(1e-5, ge=0, description="local weight decay")
    grad_clip: float | None = Field(None, gt=0, description="max global grad norm per client step")
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr_schedule=step: lr at round t = lr * lr_decay**(t // "
                                                         "lr_decay_every)")
    lr_decay_every: int = Field(1, ge=1, description="lr_schedule=step: rounds between two decays")
    lr_schedule: Literal["step", "cosine"] = Field(
        "step", description="the learning rate over rounds: step (lr_decay, lr_decay_every; a constant lr by "
                            "default) or cosine (from lr at round 0 towards lr_min at round `rounds`)")
    lr_min: float = Field(0.0, ge=0, description="lr_schedule=cosine: the floor the lr anneals towards")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="local optimiser, as torch.optim's: sgd (momentum, weight_decay), adam (weight_decay "
                           "added to the gradient) or adamw (decoupled weight_decay); fresh every stage")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="optimizer=adam/adamw: (beta1, beta2)")
    adam_eps: float = Field(1e-8, gt=0, le=1, description="optimizer=adam/adamw: the denominator's epsilon (at most "
                                                          "1: a larger one makes every step vanish)")
    stragglers: float = Field(0.0, ge=0, le=1, description="the fraction of clients that straggle each round: a "
                                                           "straggler does a uniformly drawn 1 .. S-1 of its S local "
                                                           "steps (seeded per round and client)")
    client_dropout: float = Field(0.0, ge=0, lt=1, description="the fraction of selected clients that drop out after "
                                                               "receiving the model (never answer; seeded per round "
                                                               "and client; one always stays)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="every random draw derives from it through named streams")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    out_dir: str = Field("runs", description="the folder that holds the run folder")
    run_name: str | None = Field(None, description="the run folder's name (default "
                                                   "<method>-<dataset>-<partition>-s<seed>-<time>)")
    eval_every: int = Field(1, ge=1, description="evaluate the global model every n rounds (and at the last)")
    checkpoint_every: int = Field(1, ge=1, description="write checkpoint.pt every n rounds (and after the last)")
    fail_fast: bool = Field(False, description="stop the run when a client's training raises (default: "
                                               "report it and aggregate the others)")
    executor: Literal["auto", "sequential", "vectorized"] = Field(
        "auto", description="sequential: one client after another; vectorized: a round's clients as one torch.func "
                            "program (the same results to float round-off); auto: vectorized, the faster where the "
                            "method runs vectorised and a round has more than one client, except convolutions on "
                            "the CPU (sequential there, as for channels_last = on)")
    distributed: bool = Field(False, description="spread each round's clients over the ranks of a torchrun "
                                                 "launch (rank 0 writes the run; docs/scaling.md)")
    max_parallel_clients: int | None = Field(None, ge=1, description="vectorized: clients per chunk")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="training forward's compute dtype (fp32 master weights; fp16 with dynamic loss scaling)")
    compile: Literal["off", "on", "auto"] = Field(
        "auto", description="vectorized: torch.compile of the stacked loss (forward and backward; CUDA graphs on "
                            "CUDA); auto is off until a measurement shows it pays (CPU: slower, "
                            "benchmarks/compile_speed.py)")
    channels_last: Literal["off", "on", "auto"] = Field(
        "auto", description="sequential: convolutions and image batches in the channels-last layout (NHWC); auto "
                            "is off until a GPU measurement shows it pays (benchmarks/engine_speed.py)")
    pad_batches: bool = Field(True, description="vectorized: pad a step's batches to one size (one call per step) "
                                                "where the method declares it exact and the model has no BatchNorm")
    final_personalization: bool = Field(True, description="train every client once from the final model")
    feature_stats: bool = Field(False, description="record features/eig_var_top50 at every evaluation")
    classifier_stats: bool = Field(False, description="record proxy/* (MAP Figure 6) every round")
    forgetting_stats: bool = Field(False, description="record forgetting/* (FedKA Eq. 1) every round")
    forgetting_test_samples: int | None = Field(None, ge=1, description="forgetting/* on the first n global "
                                                                       "test samples (default: all)")
    logger: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="also send every round's metrics to these trackers (fedskew.engine.tracking)")
    logger_group: str | None = Field(None, description="tracker group (a sweep sets its name)")

    _coerce = field_validator("method", "dataset", "partition", "model", mode="before")(
        lambda cls, v: _name_or_mapping(v))
    _former_keys = model_validator(mode="before")(lambda cls, data: _architecture_keys(data))
    # YAML (and the command line) read on/off as booleans
    _on_off = field_validator("compile", "channels_last", mode="before")(
        lambda cls, v: {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v)
    _loggers = field_validator("logger", mode="before")(  # logger=tensorboard or logger=tensorboard,wandb
        lambda cls, v: [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v)

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str | None) -> str | None:
        if v is not None and (v in ("", ".", "..") or any(c in v for c in "/\\\0")):
            raise ValueError("must be one folder name inside out_dir (no '/', not '.' or '..')")
        if v is not None and len(v.encode()) > 255:
            raise ValueError(f"is {len(v.encode())} bytes long; a folder name holds at most 255")
        return v

    @field_validator("out_dir")
    @classmethod
    def _out_dir(cls, v: str) -> str:
        long = [p for p in Path(v).parts if len(p.encode()) > 255]
        if long:
            raise ValueError(f"has a folder name {len(long[0].encode())} bytes long; a folder name holds at most 255")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and not (v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'")
        return v

    @model_validator(mode="after")
    def _method_options(self) -> RunConfig:
        from fedskew.algorithms import method_inert, method_model_defaults, method_run_defaults, validate_method_config

        method = validate_method_config(self.method)
        inert = method_inert(self.method, self.rounds, self.partition.num_clients, self.clients_per_round)
        if inert:  # an option that switches a part of the method off for the whole run
            warnings.warn(f"method {self.method.name}: {inert}.", InertOptionWarning, stacklevel=2)
        # the model options the method's papers use, where the config leaves them unset: before the
        # sections are checked, so that a key the method's architecture reads (model.etf_scale with
        # method=fedetf, whose classifier is the ETF head) is not refused as not applying
        for key, value in method_model_defaults(self.method).items():
            if key not in self.model.model_fields_set:
                setattr(self.model, key, value)
        problems = []
        for section in ("dataset", "partition", "model"):
            part = getattr(self, section)
            unused = part.unused_keys()
            if unused:
                what = (f"model '{part.name}' with classifier '{part.classifier}'" if section == "model"
                        else f"{section} '{part.name}'")
                problems.append(f"{', '.join(f'{section}.{k}' for k in unused)} {'does' if len(unused) == 1 else 'do'}"
                                f" not apply to {what}, which reads {sorted(part.applies() - {'name'})}")
        if problems:
            raise ValueError("; ".join(problems))
        if self.precision == "fp16" and method.sam is not None:
            raise ValueError(f"method {self.method.name}'s sharpness-aware steps (method.sam) run in fp32 or bf16, "
                             f"not precision = fp16 (no loss scaling across the two passes)")
        # the local-training settings of the method's official code, where the config leaves them unset
        for key, value in method_run_defaults(self.method).items():
            if key not in RUN_DEFAULT_KEYS:
                raise ValueError(f"method {self.method.name} declares a run default for '{key}'; a method may set "
                                 f"only {sorted(RUN_DEFAULT_KEYS)}")
            if key not in self.model_fields_set:
                self.__dict__[key] = value  # (not setattr: assignment would validate this model again)
        self._check_optimiser()
        if self.clients_per_round > self.partition.num_clients:
            raise ValueError(f"clients_per_round = {self.clients_per_round} exceeds partition.num_clients = "
                             f"{self.partition.num_clients}")
        self._check_held_out()
        if self.compile == "on" and self.executor == "sequential":
            raise ValueError("compile = on compiles the vectorized executor's stacked step; set executor = "
                             "vectorized, or compile = off")
        if self.compile == "on" and self.channels_last == "on":
            raise ValueError("compile = on (the vectorized executor) and channels_last = on (the sequential one) "
                             "ask for different executors; set one of them off")
        if self.channels_last == "on" and self.executor == "vectorized":
            raise ValueError("channels_last = on lays out the sequential executor's model and batches; set executor = "
                             "sequential, or channels_last = off")
        return self

    def _check_optimiser(self) -> None:
        """Keys of one optimiser or schedule set (to other than their defaults: a resolved config
        holds every key) with another: one sentence each."""
        fields = type(self).model_fields
        given = {k for k in self.model_fields_set if getattr(self, k) != fields[k].default}
        if self.optimizer != "sgd" and "momentum" in given:
            raise ValueError(f"momentum applies to optimizer = sgd, not {self.optimizer} (its first moment is "
                             f"adam_betas[0])")
        if self.optimizer == "sgd" and {"adam_betas", "adam_eps"} & given:
            raise ValueError(f"{', '.join(sorted({'adam_betas', 'adam_eps'} & given))} apply to optimizer = adam or "
                             f"adamw, not sgd")
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas = {list(self.adam_betas)}: each must lie in [0, 1)")
        if self.lr_schedule == "cosine" and {"lr_decay", "lr_decay_every"} & given:
            raise ValueError(f"{', '.join(sorted({'lr_decay', 'lr_decay_every'} & given))} apply to lr_schedule = "
                             f"step, not cosine (which anneals towards lr_min)")
        if self.lr_schedule == "step" and "lr_min" in given:
            raise ValueError("lr_min applies to lr_schedule = cosine, not step")
        if self.lr_min >= self.lr and self.lr_schedule == "cosine":
            raise ValueError(f"lr_min = {self.lr_min} must be below lr = {self.lr}")
        if self.lr_schedule == "step" and self.lr_decay < 1:
            # the first round whose lr falls under 1e-12 of lr: from there on nothing trains
            dead = math.floor(math.log(1e-12) / math.log(self.lr_decay)) + 1  # decays needed
            if dead * self.lr_decay_every < self.rounds:
                raise ValueError(
                    f"lr_decay = {self.lr_decay} (every {self.lr_decay_every} rounds) takes the lr under "
                    f"1e-12 of lr = {self.lr} from round {dead * self.lr_decay_every + 1} of {self.rounds}, "
                    f"so nothing would train after it; raise lr_decay or lr_decay_every"
                )

    def _check_held_out(self) -> None:
        """Held-out clients leave clients to train, at least one is held out, and they are scored."""
        part = self.partition
        if not part.held_out:
            return
        held = int(round(part.held_out * part.num_clients))
        if held == 0:
            raise ValueError(f"partition.held_out = {part.held_out} of {part.num_clients} clients holds out none; "
                             f"raise it to at least {0.5 / part.num_clients:.3g} or set 0")
        if part.num_clients - held < self.clients_per_round:
            raise ValueError(f"partition.held_out = {part.held_out} holds out {held} of {part.num_clients} clients, "
                             f"leaving {part.num_clients - held} to train, fewer than clients_per_round = "
                             f"{self.clients_per_round}")
        if not self.final_personalization or part.local_test_fraction == 0:
            raise ValueError("partition.held_out needs final_personalization = true and partition.local_test_fraction "
                             "> 0: the held-out clients are scored by the final pass on their local test splits")

    def round_lr(self, t: int) -> float:
        """The local learning rate of round ``t`` (counted from 0; ``t = rounds``: the final
        personalisation pass). step: lr * lr_decay ** (t // lr_decay_every); cosine: lr_min + (lr -
        lr_min) (1 + cos(pi t / rounds)) / 2, the final pass at the last round's lr."""
        if self.lr_schedule == "cosine":
            t = min(t, self.rounds - 1)
            return self.lr_min + (self.lr - self.lr_min) * (1 + math.cos(math.pi * t / self.rounds)) / 2
        return self.lr * self.lr_decay ** (t // self.lr_decay_every)

    def resolved(self) -> dict[str, Any]:
        """The config as plain data, with the library version (written into every run directory)."""
        return {"fedskew_version": __version__, **self.model_dump(mode="json")}


# Run keys added after run ids and checkpoint identities were first hashed, each with the value
# that means "as before the key existed": at that value a run keeps its sweep run id and its
# checkpoints' identity (experiments.spec.ADDED_KEYS, engine.rundir.run_identity).
ADDED_RUN_KEYS = {"optimizer": "sgd", "adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "lr_schedule": "step",
                  "lr_decay_every": 1, "lr_min": 0.0, "stragglers": 0.0, "client_dropout": 0.0,
                  "partition.size_exponent": 0.0, "partition.partitioner": None, "partition.partitioner_options": {},
                  "partition.held_out": 0.0, "compile": "auto",
                  "channels_last": "auto"}


def without_added(resolved: dict, added: dict) -> dict:
    """A resolved config (plain data) without the ``added`` keys (dotted: in their section) that
    are at their as-before value."""
    out = dict(resolved)
    for dotted, before in added.items():
        head, _, leaf = dotted.rpartition(".")
        section = out.get(head) if head else out
        if isinstance(section, dict) and leaf in section and section[leaf] == before:
            section = {k: v for k, v in section.items() if k != leaf}
            if head:
                out[head] = section
            else:
                out = section
    return out
RUN_DEFAULT_KEYS = frozenset({"lr", "momentum", "weight_decay", "grad_clip", "local_epochs", "batch_size"})
RECORD_KEYS = ("fedskew_version", "environment", "environment_previous", "changes")
SECTIONS = {"dataset": DatasetConfig, "partition": PartitionConfig, "model": ModelConfig}


MAX_YAML_BYTES = 1 << 20


def load_yaml(text: str, what: str):
    """Parse a config or sweep file's text: size, alias expansion and nesting bounded, one-sentence
    errors (:func:`fedskew.files.parse_yaml`)."""
    from fedskew.files import parse_yaml

    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} is {len(text):,} bytes; a config or sweep file is at most {MAX_YAML_BYTES:,}.")
    return parse_yaml(text, what)


def yaml_problem(exc: Exception) -> str:
    """A YAML error as ``line L, column C: problem``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _format_error(err: dict) -> str:
    key = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        section = SECTIONS.get(str(err["loc"][0]), RunConfig) if len(err["loc"]) > 1 else RunConfig
        hint = did_you_mean(str(err["loc"][-1]), section.model_fields)
        return (f"config key '{key}' is not known{hint}; `fedskew run --print-config` prints every key with its "
                f"value.")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if not key:
        return f"config: {msg}."
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"config key '{key}' = {shown} is not allowed: {msg[:300]}."


def validate_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        errors = [_format_error(e) for e in exc.errors()]
        more = f" (and {len(errors) - 5} more problems)" if len(errors) > 5 else ""
        raise ConfigError(" ".join(errors[:5]) + more) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. partition.classes_per_client=2).")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key; use dotted keys such as model.name=mlp.")
    from fedskew.files import BoundedLoader

    try:
        value = yaml.load(raw, Loader=BoundedLoader) if raw != "" else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML, or a number too long for Python: the text
        value = raw
    return key.split("."), value


def set_key(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data[a][b][c] = value`` for ``a.b.c``; a name on the way (``model: mlp``) becomes
    ``{"name": "mlp"}``, a missing section an empty one."""
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str):
            child = {"name": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' holds a value, not a section.")
        node[part] = child
        node = child
    node[parts[-1]] = value


def nested(flat_or_nested: dict[str, Any]) -> dict[str, Any]:
    """A copy with dotted keys (``{"partition.alpha": 0.1}``) made nested, merged with the nested
    ones (``{"partition": {"name": "dirichlet"}}``): what sweep bases and ``fedskew.run`` accept."""
    out: dict[str, Any] = {}
    for k, v in flat_or_nested.items():
        if isinstance(v, dict) and "." not in k:
            existing = out.get(k)
            out[k] = {**(existing if isinstance(existing, dict) else {}), **nested(v)}
        else:
            set_key(out, k, copy.deepcopy(v))
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items into a nested dict (values parsed as YAML scalars/lists)."""
    for item in overrides:
        path, value = parse_override(item)
        set_key(data, ".".join(path), value)
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a YAML config file (not yet validated; a run directory's
    ``fedskew_version`` key dropped), with one-sentence errors."""
    from fedskew.files import read_text

    path = Path(path)
    text = read_text(path, "config file", limit=MAX_YAML_BYTES)
    loaded = load_yaml(text, f"config file '{path}'")
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys, not a {type(loaded).__name__}.")
    data = loaded or {}
    if "fedskew_version" in data:  # a run directory's record: before 0.2 it listed every key
        _drop_recorded_defaults(data)
        if isinstance(data.get("model"), dict):  # the method's own architecture, as its defaults set it
            for key in ARCHITECTURE_KEYS:
                data["model"].pop(key, None)
    for key in RECORD_KEYS:  # what a run directory's config.yaml records beside the config
        data.pop(key, None)
    return data


def _drop_recorded_defaults(record: dict[str, Any]) -> None:
    """Remove from a recorded config the section keys its names do not read, where they hold the
    default (runs recorded before sections had one schema per name wrote every key)."""
    for section, schema in SECTIONS.items():
        part = record.get(section)
        if not isinstance(part, dict):
            continue
        try:
            keep = schema.model_validate({k: v for k, v in part.items() if k in schema.model_fields}).applies()
        except ValidationError:
            continue  # validation later names the problem
        for key in [k for k in part if k not in keep and k in schema.model_fields]:
            if part[key] == schema.model_fields[key].default:
                del part[key]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML file (optional), apply overrides, validate."""
    data = read_config_file(path) if path is not None else {}
    return validate_config(apply_overrides(data, overrides or []))
