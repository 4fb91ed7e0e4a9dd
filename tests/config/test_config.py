import pytest

from hybridrl.config import ConfigError
from hybridrl.config.io import config_to_yaml, load_config, parse_overrides


def test_defaults_resolve_and_roundtrip_yaml(tmp_path):
    cfg = load_config()
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(str(path)) == cfg


def test_yaml_plus_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_steps: 7\nalgo:\n  kl:\n    coef: 0.05\n")
    cfg = load_config(str(path), ["trainer.total_steps=200", "algo.kl.coef=0", "data.operations=+*"])
    assert cfg.trainer.total_steps == 200 and cfg.algo.kl.coef == 0.0 and cfg.data.operations == "+*"


def test_override_types_parse_as_yaml():
    tree = parse_overrides(["optim.betas=[0.8,0.95]", "rollout.quantization=null", "algo.kl.use_loss=false"])
    assert tree == {"optim": {"betas": [0.8, 0.95]}, "rollout": {"quantization": None},
                    "algo": {"kl": {"use_loss": False}}}
    cfg = load_config(None, ["optim.betas=[0.8,0.95]", "algo.kl.use_loss=false"])
    assert cfg.optim.betas == [0.8, 0.95] and cfg.algo.kl.use_loss is False


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.total_step=5"], "did you mean trainer.total_steps"),
    (["algo.kl_cof=0.1"], "did you mean algo.kl.coef"),
    (["traner.total_steps=5"], "did you mean trainer"),
    (["algo.kl.coef=abc"], "algo.kl.coef='abc': expected a number"),
    (["trainer.total_steps=1.5"], "trainer.total_steps=1.5: expected an integer"),
    (["logging.plot=3"], "expected true or false"),
    (["batch.mini_batch_size=7"], "does not divide the batch"),
    (["rollout.n=1", "batch.mini_batch_size=32"], "set rollout.n >= 2"),
    (["rollout.quantization=int4"], "use null, fp8 or fp8_block"),  # also names mxfp4
    (["rollout.top_p=0"], "rollout.top_p"),
    (["data.operations=/"], "data.operations"),
    (["optim.betas=[0.9]"], "give two numbers"),
    (["algo.policy_loss.clip_ratio_c=0.5"], "c > 1"),
    (["trainerx"], "expected group.key=value"),
    (["algo.kl_coef=0.1"], "algo.kl_coef was renamed to algo.kl.coef"),
    (["algo.adv_estimator=gae"], "renamed to algo.advantage.estimator"),
    (["algo.policy_loss=gspo"], "use algo.policy_loss.name=gspo"),
    (["algo.preset=gpso"], "did you mean 'gspo'"),
    (["algo.advantage.estimator=grop"], "did you mean 'grpo'?"),
    (["optim.lr=inf"], "optim.lr=inf"),
    (["optim.grad_clip=-1"], "optim.grad_clip"),
    (["optim.grad_clip=0"], "optim.grad_clip"),
    (["rollout.temperature=nan"], "rollout.temperature"),
    (["algo.kl.coef=nan"], "algo.kl.coef"),
    (["algo.policy_loss.clip_ratio_low=-0.1"], "clip_ratio_low"),
    (["data.eval_size=-5"], "data.eval_size"),
    (["data.train_size=0"], "data.train_size"),
    (["reward.timeout_s=nan"], "reward.timeout_s"),
    (["rollout.max_tokens=100000000"], "rollout.max_tokens"),
    (["data.train_size=10", "batch.prompts_per_step=32"], "exceeds data.train_size"),
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


@pytest.mark.parametrize("preset, expect", [
    ("gspo", {"policy_loss.name": "gspo", "policy_loss.clip_ratio_low": 3e-4, "policy_loss.clip_ratio_high": 4e-4,
              "loss_agg_mode": "seq-mean-token-mean", "kl.coef": 0.0}),
    ("dr_grpo", {"advantage.estimator": "dr_grpo", "loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("dapo", {"policy_loss.clip_ratio_high": 0.28, "dapo.dynamic_sampling": True, "dapo.overlong_buffer_len": 1,
              "loss_agg_mode": "token-mean"}),
    ("grpo", {"loss_agg_mode": "seq-mean-token-mean", "kl.coef": 0.04, "kl.estimator": "k3", "kl.use_loss": True}),
    ("rlhf_ppo", {"advantage.estimator": "gae", "advantage.lam": 0.95, "value.cliprange": 0.2, "kl.coef": 0.05,
                  "kl.estimator": "k1", "kl.use_loss": False, "loss_agg_mode": "token-mean"}),
])
def test_presets_set_paper_defaults(preset, expect):
    cfg = load_config(None, [f"algo.preset={preset}"])
    for key, want in expect.items():
        node = cfg.algo
        for part in key.split("."):
            node = getattr(node, part)
        assert node == want, (preset, key, node)


def test_preset_keys_can_be_overridden_one_by_one(tmp_path):
    cfg = load_config(None, ["algo.preset=gspo", "algo.policy_loss.clip_ratio_high=5e-4"])
    assert cfg.algo.policy_loss.clip_ratio_high == 5e-4 and cfg.algo.policy_loss.clip_ratio_low == 3e-4
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  preset: dapo\n  dapo:\n    refill_rounds: 1\nrollout:\n  max_tokens: 40\n")
    cfg = load_config(str(path))
    assert cfg.algo.dapo.refill_rounds == 1 and cfg.algo.dapo.dynamic_sampling
    assert cfg.algo.dapo.overlong_buffer_len == 8  # a fifth of the resolved max_tokens
    # the resolved config round-trips through YAML (what `hybridrl config` prints)
    again = tmp_path / "resolved.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(str(again)) == cfg


def test_cli_config_shows_resolved_preset(capsys):
    from hybridrl.cli import main

    assert main(["config", "algo.preset=gspo"]) == 0
    out = capsys.readouterr().out
    assert "preset: gspo" in out and "clip_ratio_low: 0.0003" in out and "seq-mean-token-mean" in out


def test_reward_model_and_judge_shorthands(tmp_path):
    """reward.model / reward.judge name the reward (summed when both); with an explicit
    reward.functions they are refused in one line (the list form combines them); the resolved
    config round-trips."""
    cfg = load_config(None, ["reward.model=rm_dir", "reward.judge=judge_dir"])
    assert cfg.reward.spec == [{"name": "reward_model", "path": "rm_dir"}, {"name": "judge", "path": "judge_dir"}]
    assert load_config(None, []).reward.spec == "exact_match"
    again = tmp_path / "resolved.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(str(again)) == cfg
    with pytest.raises(Exception) as e:
        load_config(None, ["reward.model=rm_dir", "reward.functions=gsm8k"])
    assert "\n" not in str(e.value) and "reward.functions=[{name: reward_model" in str(e.value)
