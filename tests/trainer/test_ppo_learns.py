"""PPO with a critic (GAE) learns: every update of a real run moves the policy up the PPO
objective of its own batch, and the critic down its value loss, as a float64 recomputation
independent of the trainer measures them.

Why this and not "held-out accuracy rises by X within N steps": how far a few sampled RL
steps move the accuracy is a statistical outcome that depends on the machine's float
rounding (an earlier version of this test measured +0.15 to +0.29 over four seeds on one
CPU and asserted +0.1). What the numerics do guarantee is the direction of each update, so
that is what is checked, at every step, with a bound that follows from the optimizer:

- each RL step is one optimizer step over the whole batch (one epoch, one mini-batch), so
  the policy starts the update at the weights that sampled it: ratio 1, no clipping, and the
  objective's gradient is ``g = grad J``, ``J = sum(A * log pi(token)) / tokens`` (token-mean);
- AdamW with ``beta1 = 0`` and no weight decay moves each parameter by
  ``lr * c * g_i / (sqrt(v_i) + eps)`` (``c > 0``: gradient clipping): every coordinate has
  the sign of its gradient. So ``sum(g_i * delta_i) = sum(|g_i| * |delta_i|)`` exactly, and
  the alignment ``rho = g . delta / sum(|g_i| |delta_i|)`` is 1.
  The trainer's float32 gradient differs from this float64 one by rounding only: coordinates
  whose sign rounding can flip have gradients at rounding level, a share of ``sum |g_i||delta_i|``
  orders of magnitude below 1%. ``rho > 0.99`` then holds on any machine, while a wrong sign
  (rho = -1), a missing step (no movement) or gradients of the wrong tokens (a partial
  correlation) fail it;
- the critic's update is one AdamW step (same betas) on ``sum((V - R)^2) / tokens``: its
  alignment with the value loss's gradient is -1 the same way.
"""

import copy

import _seeds
import torch
from _tiny import TINY_MODEL

from hybridrl.config.io import load_config
from hybridrl.job.loop import train
from hybridrl.trainer.actor import Actor
from hybridrl.trainer.critic import Critic

STEPS = 4
ALIGNED = 0.99  # see the module docstring: 1 up to the trainer's float32 rounding


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def _alignment(grad: torch.Tensor, delta: torch.Tensor) -> float:
    """``grad . delta / sum |grad_i| |delta_i|``: 1 when every coordinate moved along its gradient."""
    return float((grad * delta).sum() / (grad.abs() * delta.abs()).sum())


def _objective_gradient(policy, batch, temperature: float) -> torch.Tensor:
    """grad of J = sum(A * log pi(token)) / response tokens, one row at a time, float64."""
    model = copy.deepcopy(policy).double()
    ids, am, rm, adv = batch["input_ids"], batch["attention_mask"], batch["response_mask"], batch["advantages"]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(ids.shape[0]):
        n = int(am[i].sum())  # right padding: the row's tokens are its first n
        logits = model(input_ids=ids[i:i + 1, :n]).logits[0] / temperature
        logp = torch.log_softmax(logits[:-1], -1).gather(1, ids[i, 1:n, None])[:, 0]  # token t+1's log-prob
        total = total + (adv[i, 1:n].double() * rm[i, 1:n].double() * logp).sum()
    objective = total / rm.double().sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return _flat(torch.autograd.grad(objective, params))


def _value_loss_gradient(value_model, batch) -> torch.Tensor:
    """grad of sum(mask * (V - R)^2) / tokens, float64; V at position t is the value head on
    the hidden state after token t-1 (the state before token t is chosen)."""
    model = copy.deepcopy(value_model).double()
    ids, am, rm, returns = batch["input_ids"], batch["attention_mask"], batch["response_mask"], batch["returns"]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(ids.shape[0]):
        n = int(am[i].sum())
        hidden = model.backbone(input_ids=ids[i:i + 1, :n]).last_hidden_state[0]  # (n, H)
        v = hidden @ model.value_head.weight[0]  # (n,): the value after reading token t
        m, r = rm[i, 1:n].double(), returns[i, 1:n].double()
        total = total + (m * (v[:-1] - r) ** 2).sum()
    loss = total / rm.double().sum()
    return _flat(torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))


def _recording(cls, steps: list):
    """``cls.update`` that also records the batch, the model before and the parameter step."""
    real = cls.update

    def update(self, batch, **kw):
        before = copy.deepcopy(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        out = real(self, batch, **kw)
        steps.append((before, {k: v.clone() for k, v in batch.items()},
                      _flat(p.detach() for p in params) - _flat(start)))
        return out

    return update


def test_every_ppo_update_ascends_its_objective_and_the_critic_descends(tmp_path, monkeypatch):
    seed = _seeds.fresh_seed()
    cfg = load_config(None, TINY_MODEL + [
        f"trainer.seed={seed}", "algo.advantage.estimator=gae", "algo.advantage.lam=0.95",
        f"trainer.total_steps={STEPS}", "trainer.eval_every=100", "trainer.threads=1", "warm_start.steps=30",
        "data.train_size=200", "data.eval_size=8", "batch.prompts_per_step=8", "batch.ppo_epochs=1",
        "optim.betas=[0.0,0.99]", "optim.weight_decay=0", "logging.tensorboard=false", "logging.plot=false",
        "checkpoint.save=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=ppo"])
    assert cfg.batch.mini_batch_size == cfg.batch.prompts_per_step * cfg.rollout.n  # one optimizer step a batch
    actor_steps, critic_steps = [], []
    monkeypatch.setattr(Actor, "update", _recording(Actor, actor_steps))
    monkeypatch.setattr(Critic, "update", _recording(Critic, critic_steps))
    train(cfg)
    assert len(actor_steps) == len(critic_steps) == STEPS, seed

    for step, ((policy, batch, delta), (critic, critic_batch, critic_delta)) in enumerate(
            zip(actor_steps, critic_steps), start=1):
        assert batch["advantages"].abs().max() > 0, (seed, step)  # GAE's advantages are never all zero
        assert delta.abs().max() > 0 and critic_delta.abs().max() > 0, f"seed {seed} step {step}: no update"
        rho = _alignment(_objective_gradient(policy, batch, cfg.rollout.temperature), delta)
        assert rho > ALIGNED, f"seed {seed} step {step}: the policy update's alignment with grad J is {rho}"
        rho_v = _alignment(_value_loss_gradient(critic, critic_batch), critic_delta)
        assert rho_v < -ALIGNED, f"seed {seed} step {step}: the critic update's alignment with its loss is {rho_v}"
