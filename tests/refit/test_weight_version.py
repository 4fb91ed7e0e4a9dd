"""The weight version a refit publishes is the caller's (the trainer's batch source owns the
number): the engine records the version it is handed, +1 when none is, and refuses one that
is not an int >= 1 in one line with nothing committed."""
import pytest
import torch

from hybridrl.refit import Refit, refit_from_model
from hybridrl.rollout import SamplingParams
from tests.refit.helpers import engine, hf_model, perturb, qwen2_config

NOT_A_VERSION = "version=.* must be an int >= 1"


def test_a_refit_records_the_version_it_is_handed():
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg)
    stats = refit_from_model(eng, hf, version=7, verify=True)
    assert stats.version == eng.weight_version == 7
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, seed=0)).weight_version == 7
    perturb(hf, seed=1)
    assert refit_from_model(eng, hf).version == eng.weight_version == 8  # none handed: +1
    assert refit_from_model(eng, hf, version=3).version == eng.weight_version == 3  # recorded as is


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_version_that_is_not_an_int_from_1_is_refused_in_one_line(bad):
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg)
    refit_from_model(eng, hf, version=4)
    with pytest.raises(ValueError, match=NOT_A_VERSION) as e:
        refit_from_model(eng, hf, version=bad)
    assert "\n" not in str(e.value)
    assert eng.weight_version == 4 and not eng.weight_update_in_progress
    with pytest.raises(ValueError, match=NOT_A_VERSION):
        Refit(eng, version=bad)  # refused before anything is sent


def test_the_engine_bracket_refuses_a_bad_version_and_closes_the_update():
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg)
    eng.begin_weight_update()
    eng.load_weights([(n, p.detach()) for n, p in hf.named_parameters()])
    with pytest.raises(ValueError, match=NOT_A_VERSION):
        eng.finish_weight_update(version=0)
    assert eng.weight_version == 0 and not eng.weight_update_in_progress
    with eng.weight_update(version=5):
        eng.load_weights([(n, p.detach().to(torch.float32)) for n, p in hf.named_parameters()])
    assert eng.weight_version == 5
