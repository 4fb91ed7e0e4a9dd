import pytest

from hybridrl.config import ConfigError
from hybridrl.config_io import config_to_yaml, load_config, parse_overrides


def test_defaults_resolve_and_roundtrip_yaml(tmp_path):
    cfg = load_config()
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(str(path)) == cfg


def test_yaml_plus_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_steps: 7\nalgo:\n  kl_coef: 0.05\n")
    cfg = load_config(str(path), ["trainer.total_steps=200", "algo.kl_coef=0", "data.operations=+*"])
    assert cfg.trainer.total_steps == 200 and cfg.algo.kl_coef == 0.0 and cfg.data.operations == "+*"


def test_override_types_parse_as_yaml():
    tree = parse_overrides(["optim.betas=[0.8,0.95]", "rollout.quantization=null", "algo.use_kl_loss=false"])
    assert tree == {"optim": {"betas": [0.8, 0.95]}, "rollout": {"quantization": None},
                    "algo": {"use_kl_loss": False}}
    cfg = load_config(None, ["optim.betas=[0.8,0.95]", "algo.use_kl_loss=false"])
    assert cfg.optim.betas == [0.8, 0.95] and cfg.algo.use_kl_loss is False


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.total_step=5"], "did you mean trainer.total_steps"),
    (["algo.kl_cof=0.1"], "did you mean algo.kl_coef"),
    (["traner.total_steps=5"], "did you mean trainer"),
    (["algo.kl_coef=abc"], "algo.kl_coef='abc': expected a number"),
    (["trainer.total_steps=1.5"], "trainer.total_steps=1.5: expected an integer"),
    (["logging.plot=3"], "expected true or false"),
    (["trainer.mini_batch_size=7"], "does not divide the batch"),
    (["rollout.n=1", "trainer.mini_batch_size=32"], "set rollout.n >= 2"),
    (["rollout.quantization=int4"], "use null, fp8 or fp8_block"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["data.operations=/"], "data.operations"),
    (["optim.betas=[0.9]"], "give two numbers"),
    (["algo.clip_ratio_c=0.5"], "c > 1"),
    (["trainerx"], "expected group.key=value"),
])
def test_errors_are_one_line_and_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    notmap = tmp_path / "list.yaml"
    notmap.write_text("trainer: 3\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(notmap))


def test_cli_config_and_help(capsys):
    from hybridrl.cli import main

    assert main(["config", "trainer.total_steps=3"]) == 0
    assert "total_steps: 3" in capsys.readouterr().out
    assert main(["train", "trainer.total_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean trainer.total_steps" in err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for group in ("model:", "data:", "rollout:", "algo:", "optim:", "trainer:", "logging:"):
        assert group in out
