"""DCP checkpoints of an optimizer whose parameters did not all receive a gradient (DeepSeek-V4's
lightning indexer never does: its top-k picks carry none) load into a fresh optimizer: the save
writes the zero state a load builds, and moves no weight or other state doing so."""
import warnings

import torch

from hybridrl.checkpoint.dcp import load_dcp, save_dcp


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, optimizer, x):
    model["used"](x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_parameter_without_gradients_does_not_break_the_resume(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    x = torch.randn(3, 4)
    _step(model, optimizer, x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model["used"].weight].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warning
        save_dcp(tmp_path / "ck", model, optimizer)
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # the save moved nothing
        assert all(torch.equal(v, moments[k]) for k, v in optimizer.state[model["used"].weight].items())
        resumed, resumed_optimizer = _model_and_optimizer(1)
        load_dcp(tmp_path / "ck", resumed, resumed_optimizer)  # raised "Missing key ... unused.weight.step"
    assert all(torch.equal(v, weights[k]) for k, v in resumed.state_dict().items())
    _step(model, optimizer, x)
    _step(resumed, resumed_optimizer, x)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in resumed.state_dict().items())
