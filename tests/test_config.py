import warnings

import pytest

from fedskew.config import ConfigError, apply_overrides, load_config


def one_sentence(msg: str) -> bool:
    return msg.count(". ") == 0 and msg.endswith(".")


def test_defaults_are_the_documented_contract():
    cfg = load_config()
    assert (cfg.method.name, cfg.dataset.name, cfg.partition.name, cfg.model.name) == (
        "fedavg",
        "digits",
        "pcdd",
        "mlp",
    )
    for key in ["method", "dataset", "partition", "model", "rounds", "clients_per_round", "local_epochs",
                "batch_size", "lr", "seed", "device", "out_dir"]:
        assert key in cfg.model_dump()


def test_overrides_nested_and_typed():
    cfg = load_config(None, ["partition.classes_per_client=2", "lr=0.1", "model.hidden=[8, 4]",
                             "method.weighting=uniform", "grad_clip=1"])
    assert cfg.partition.classes_per_client == 2 and cfg.lr == 0.1 and cfg.model.hidden == [8, 4]
    assert cfg.method.options == {"weighting": "uniform"} and cfg.grad_clip == 1.0


def test_string_section_then_nested_override():
    data = apply_overrides({"model": "mlp"}, ["model.hidden=[3]"])
    assert data == {"model": {"name": "mlp", "hidden": [3]}}


@pytest.mark.parametrize("override,fragment", [
    (["partition.classes_per_clinet=2"], "config key 'partition.classes_per_clinet' is not known"),
    (["partition.classes_per_client=0"], "'partition.classes_per_client' = 0 is not allowed"),
    (["dataset.name=cifar7"], "'dataset.name' = 'cifar7' is not allowed"),
    (["lr=-1"], "'lr' = -1 is not allowed"),
    (["device=tpu"], "'device' = 'tpu' is not allowed: must be 'cpu', 'cuda' or 'cuda:N'"),
    (["method=fedfoo"], "method.name 'fedfoo' is not known"),
    (["method.weighting=random"], "method.weighting = 'random' is not allowed"),
    (["method.mu=1"], "method.mu is not an option of fedavg"),
    (["clients_per_round=50"], "clients_per_round = 50 exceeds partition.num_clients = 20"),
])
def test_bad_values_give_one_sentence_naming_key_and_value(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    msg = str(info.value)
    assert fragment in msg, msg
    assert "\n" not in msg and "Traceback" not in msg


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["rounds"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_yaml_file_with_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("method: fedavg\npartition: {name: dirichlet, alpha: 0.3}\nrounds: 7\n")
    cfg = load_config(tmp_path / "c.yaml", ["rounds=9"])
    assert cfg.partition.name == "dirichlet" and cfg.partition.alpha == 0.3 and cfg.rounds == 9


def test_example_configs_validate():
    from pathlib import Path

    import yaml

    from fedskew.experiments.sweep import load_spec, plan

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        if "methods" in (yaml.safe_load(path.read_text()) or {}):  # a sweep: every planned run validates
            assert plan(load_spec(path))
        else:
            load_config(path)


def test_a_key_of_the_architecture_a_method_chooses_is_not_refused():
    """Issue 46: the sections were checked before the method's model defaults applied, so a key of
    the ETF head the method makes its classifier was refused with "classifier 'linear'"."""
    assert load_config(None, ["method=fedetf", "model.etf_scale=2"]).model.etf_scale == 2.0
    assert load_config(None, ["method=etf_gmv", "model.etf_scale=2"]).model.classifier == "etf"
    assert load_config(None, ["method=fedgela", "model.etf_normalize=true"]).model.etf_normalize is True
    with pytest.raises(ConfigError, match="model.etf_scale does not apply to model 'mlp' with classifier 'linear'"):
        load_config(None, ["model.etf_scale=2"])


BAD_RUNS = [  # issue 54's probes: each was a traceback, a silent no-op or a run that never ends
    (["method=fedgh", "method.weighting=uniform"], "method.weighting = 'uniform' changes nothing for method fedgh"),
    (["method=feddyn", "method.weighting=batches"], "changes nothing for method feddyn"),
    (["method=fedah", "method.head_epochs=1000000000"], "method.head_epochs = 1000000000 is not allowed"),
    (["optimizer=adam", "adam_eps=inf"], "'adam_eps' = 'inf' is not allowed"),
    (["optimizer=adam", "adam_eps=1e308"], "'adam_eps' = '1e308' is not allowed"),
    (["lr_decay=1e-300"], "takes the lr under 1e-12 of lr = 0.01 from round 2 of 50"),
    (["partition.name=inner_dirichlet", "partition.alpha=inf"], "'partition.alpha' = 'inf' is not allowed"),
    (["partition.name=flwr", "partition.partitioner=ShardPartitioner",
      "partition.partitioner_options={num_shards_per_partition: 1000000000}"],
     "partition ShardPartitioner with {'num_shards_per_partition': 1000000000} failed: division by zero."),
    (["--import", "empty_message.py"], "--import 'empty_message' failed: RuntimeError: (no message)."),
    (["--import", "exits.py"], "--import 'exits' called sys.exit(0) while being imported"),
]


@pytest.mark.parametrize("args,says", BAD_RUNS)
def test_bad_runs_are_one_sentence_from_the_command_line(tmp_path, args, says):
    import subprocess
    import sys

    (tmp_path / "empty_message.py").write_text("raise RuntimeError('')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    flags = [a for a in args if a == "--import" or a.endswith(".py")]
    out = subprocess.run([sys.executable, "-m", "fedskew.cli", "run", *flags, *[a for a in args if a not in flags],
                          "rounds=1" if "lr_decay" not in str(args) else "rounds=50"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/checkpoint.pt"))


@pytest.mark.parametrize("override,says", [
    (["method=ghbm", "method.tau=50", "rounds=50"], "method ghbm: tau = 50 is not below rounds = 50"),
    (["method=cfl", "rounds=20"], "method cfl: start_round = 20 is not below rounds = 20: no cluster is ever split"),
    (["method=fedcross", "method.first_stage_rounds=99"], "cross aggregation never starts"),
    (["method=knnper", "method.scale=1e-300"], "the kNN part of the output vanishes"),
    (["method=fedcm", "method.alpha=1e-300"], "so nothing trains"),
    (["method=floco", "method.tau=60"], "the clients are never projected"),
])
def test_an_option_that_switches_a_part_of_the_method_off_for_the_run_is_said_at_start(override, says):
    """Issue 54, item 16: such options were silently accepted; now the run starts with one warning."""
    from fedskew.config import InertOptionWarning

    with pytest.warns(InertOptionWarning, match=says.replace("(", r"\(")):
        load_config(None, override)
    with warnings.catch_warnings():  # at its defaults (and rounds past the switch) nothing is said
        warnings.simplefilter("error", InertOptionWarning)
        load_config(None, [o for o in override if not o.startswith("method.")] + ["rounds=100"])


def test_fedexp_refuses_an_infinite_epsilon():
    with pytest.raises(ConfigError, match="method.epsilon = 'inf' is not allowed"):
        load_config(None, ["method=fedexp", "method.epsilon=inf"])
