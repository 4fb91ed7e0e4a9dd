"""The composition matrix: every ``trainer.mode`` x task x ranks x tensor parallelism x engine
that makes sense, each a real job (real processes, real engines, tiny models, 3 RL steps; 5
for invariant 3), each checking the invariant its combination promises. One batch source serves every mode
(``hybridrl/pipeline/source.py``), so these are the same code path under different settings.

Axes: mode {sync, one_step_off, async}; task {single_turn, agent (the calculator tools,
``examples/calculator_agent.yaml`` shrunk)}; ranks {1, 2 (gloo, FSDP2, launched from the test
process)}; ``rollout.tensor_parallel_size`` {1, 2 (at 2 ranks)}; engine {built-in, vLLM};
plus LoRA (``model.lora.rank=4``) and MoE with routing replay (``model.arch=deepseek_v3``,
``rollout.routing_replay=true``) on a subset.

=============================================  ===================================================
test [ids]                                     runs -> invariants checked
=============================================  ===================================================
staleness_zero_one_rank[task-placement]        sync, async (max_staleness 0, colocated |
                                               disaggregated), 1 rank -> 1
two_ranks_at_staleness_zero                    single-turn: sync 1 process, sync 2 ranks, async 2
                                               ranks (max_staleness 0, colocated) -> 1 (async 2 ==
                                               sync 2), 2 (sync 2 == 1 process, async 2 == 1 process)
tp2_sync[task]                                 sync 1 process, sync 2 ranks with one TP=2 engine -> 2
tp2_overlapped_refused[mode]                   one_step_off | async at 2 ranks, TP=2 -> one-line refusal
variants_async_one_rank[lora|moe-colocated]    sync, async (max_staleness 0), 1 rank -> 1
vllm_staleness_zero                            sync, async (max_staleness 0) on vLLM, 1 rank,
                                               single-turn -> 1 (skipped without vLLM)
staleness_bound[mode-task]                     one_step_off | async, 1 rank, drawn producer speeds,
                                               max_staleness and placement -> 3
dynamic_sampling_quota[mode-task-ranks-var]    every mode x task x {1, 2} ranks with DAPO refills
                                               -> 4 (and 3 in the overlapped modes, drawn as above:
                                               the 2-rank overlapped runs are invariant 3 at 2 ranks);
                                               var: the 2-rank single-turn sync run has LoRA, the
                                               2-rank single-turn async run MoE with routing replay
=============================================  ===================================================

Invariants:

1. ``trainer.mode=async pipeline.max_staleness=0`` is sync bit for bit: every logged non-timing
   metric at every step (``async/*`` keys only in the async run; ``refit/bytes``, the trainer's
   own engine refit, only in the sync run) and the final weights. Agents run with
   ``env.overlap=false`` everywhere here (environment results applied at deterministic
   engine steps; the default overlap is timing-dependent by design).
2. 2 ranks == 1 process at staleness 0 (sync; async at max_staleness 0; sync with a TP=2
   engine): every step's sampled rows compared as multisets (the ranks' shares together);
   where they agree, ``reward/mean`` exactly (the reward's values are small integers: exact
   means, see ``_composition.score``) and the losses (``actor/pg_loss``, ``actor/entropy``,
   ``actor/kl_loss``) within 1e-5 of max(1, |loss|). Step 1 samples from bitwise-equal weights
   and must sample the same rows; from step 2 the weights differ by summation order, a
   sampling near-tie may flip a token, and the comparison stops there with a printed note
   (never a looser tolerance).
3. No sample is trained more than ``max_staleness`` versions after it started (one_step_off:
   1): drawn per run — ``rollout.step_latency_ms`` in [0, 20], ``env.latency_ms`` in [0, 50]
   (agents), ``pipeline.max_staleness`` in {1, 2, 3} (async), the placement — the run completes
   (the source raises on a broken bound), every logged ``async/staleness_max`` is within the
   bound, the ``async/staleness_hist_*`` shares sum to 1, and, recomputed from every rank's
   batches (the recorder), every sample's start version (its first token's) is within the
   bound of the version that trains it. (At 2 ranks the logged ``async/staleness_max`` is the
   ranks' mean of their maxima, ``algos/metrics.py``; the per-rank check is the recorder's.)
4. DAPO dynamic sampling fills its quota in every mode, task and rank count
   (``algo.dapo.refill_rounds=6``, enough for this reward). Per rank ``r`` and step, with ``G``
   the rank's prompt groups per step, ``n`` samples per group, ``R`` the refill rounds admitted
   and ``I`` the informative groups (differing rewards) among its ``(R + 1) G``: the batch holds
   exactly ``(R + 1) G`` groups; ``I >= G`` (the quota: the logged ``batch/kept_fraction =
   I n / ((R + 1) G n)``, so ``kept_fraction * (R + 1) >= 1`` is the same statement); refills
   only when needed (fewer than ``G`` informative among the first ``R G``); the rank trained
   exactly ``G n`` rows, the rows of its first ``G`` informative groups; and the logged
   ``batch/kept_fraction`` / ``batch/refill_rounds`` are the ranks' means of these per-rank
   values, exactly.

Refused, and why: one_step_off / async with ``rollout.tensor_parallel_size > 1``
(``pipeline/build.py::check_composable``: an overlapped producer runs a whole engine on its
own thread or process, a TP engine's shards step together on the ranks' trainer threads).
Not in the matrix, and where it runs: 2 ranks == 1 process with LoRA / MoE replay
(``tests/distributed/test_data_parallel.py``, ``test_tensor_parallel.py``); vLLM at 2 ranks
(it needs ``tensor_parallel_size=2``, one vLLM engine over both ranks, whose CPU all-reduce
takes the host-wide ``vllm-tp`` lock of ``tests/conftest.py``:
``tests/vllm_backend/test_vllm_training.py``); vLLM with agents
(``tests/vllm_backend/test_vllm_agents.py``); Ray producers (``tests/distributed``).

Cost: 10 two-rank launches (each ~30 s of interpreter start-up on one core, whatever the job),
the rest in this process; the jobs themselves take 1-3 s. The agent jobs sample up to 40 tokens
per turn, not 4-8: a tool call is ~40 characters of the chat char tokenizer (``_composition.AGENT``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import _seeds
import pytest
from _composition import (TASKS, assert_bitwise_equal, assert_same_as_one_process,
                          assert_started_within_bound, job, run_job)

AGENT_EXACT = ["env.overlap=false"]


def _exact(task: str) -> list[str]:
    return AGENT_EXACT if task == "agent" else []


def _note(notes: list[str]) -> None:
    for line in notes:
        print(f"note: {line}", file=sys.stderr)


# ---- invariant 1 at 1 rank ------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("task", TASKS)
def test_staleness_zero_one_rank(tmp_path: Path, monkeypatch, task: str, placement: str) -> None:
    seed = _seeds.fresh_seed()
    sync = run_job(tmp_path, "sync", task, _exact(task), seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", task, _exact(task) + ["trainer.mode=async", "pipeline.max_staleness=0",
                                                          f"pipeline.placement={placement}"],
                seed=seed, monkeypatch=monkeypatch)
    assert any(r["actor/grad_norm"] > 0 for r in sync.steps()), f"seed {seed}: no gradient, nothing compared"
    assert all(r["async/staleness_max"] == 0.0 for r in a.steps()), seed
    assert_bitwise_equal(sync, a)
    assert_started_within_bound(a, 0)


# ---- invariants 1 and 2 at 2 ranks ----------------------------------------------------------------
def test_two_ranks_at_staleness_zero(tmp_path: Path, monkeypatch) -> None:
    """Single-turn (agents at 2 ranks: ``test_tp2_sync[agent]`` for invariant 2, the 2-rank
    ``test_dynamic_sampling_quota[*-agent-2]`` runs in every mode)."""
    seed, task = _seeds.fresh_seed(), "single_turn"
    one = run_job(tmp_path, "one", task, _exact(task), seed=seed, monkeypatch=monkeypatch)
    sync2 = run_job(tmp_path, "sync2", task, _exact(task), seed=seed, monkeypatch=monkeypatch, ranks=2)
    async2 = run_job(tmp_path, "async2", task, _exact(task) + ["trainer.mode=async", "pipeline.max_staleness=0",
                                                                "pipeline.placement=colocated"],
                     seed=seed, monkeypatch=monkeypatch, ranks=2)
    assert_bitwise_equal(sync2, async2)
    _note(assert_same_as_one_process(one, sync2))
    _note(assert_same_as_one_process(one, async2))


# ---- tensor-parallel rollout ----------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_tp2_sync(tmp_path: Path, monkeypatch, task: str) -> None:
    seed = _seeds.fresh_seed()
    one = run_job(tmp_path, "one", task, _exact(task), seed=seed, monkeypatch=monkeypatch)
    tp2 = run_job(tmp_path, "tp2", task, _exact(task) + ["rollout.tensor_parallel_size=2"], seed=seed,
                  monkeypatch=monkeypatch, ranks=2)
    _note(assert_same_as_one_process(one, tp2))


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_tp2_overlapped_refused(tmp_path: Path, mode: str) -> None:
    """Refused in one line before anything is built: ``train`` of the 2-rank config in this
    process, unlaunched, is what every launched rank runs first (``job/build.py::build_run``
    checks composability before building anything; the launcher then reports the first
    rank's line, ``launch/elastic.py``)."""
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    seed = _seeds.fresh_seed()
    _, overrides = job("single_turn", f"trainer.mode={mode}", "rollout.tensor_parallel_size=2",
                       "launcher.nproc_per_node=2", f"trainer.seed={seed}", f"trainer.output_dir={tmp_path}",
                       "trainer.run_name=refused")
    with pytest.raises(ValueError) as e:
        train(load_config(None, overrides))
    line = str(e.value)
    assert "\n" not in line, line
    assert f"trainer.mode={mode} with rollout.tensor_parallel_size=2" in line, line
    assert "use tensor_parallel_size=1" in line and "trainer.mode=sync" in line, line
    assert not (tmp_path / "refused").exists(), f"seed {seed}: a refused run made its run directory"


# ---- LoRA and MoE (routing replay) on a subset ----------------------------------------------------
VARIANTS = {"lora": ["model.lora.rank=4", "optim.lr=3e-3"],
            "moe": ["model.arch=deepseek_v3", "rollout.routing_replay=true"]}


@pytest.mark.parametrize("placement", ["colocated"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_async_one_rank(tmp_path: Path, monkeypatch, variant: str, placement: str) -> None:
    """Invariant 1 with LoRA (adapter refits into a worker process) and MoE routing replay
    (the worker's routing decisions replayed by the trainer). At 2 ranks they run in
    ``test_dynamic_sampling_quota[sync-single_turn-2-lora]`` / ``[async-single_turn-2-moe]``."""
    seed = _seeds.fresh_seed()
    extra = VARIANTS[variant]
    one = run_job(tmp_path, "sync", "single_turn", extra, seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", "single_turn", extra + ["trainer.mode=async", "pipeline.max_staleness=0",
                                                            f"pipeline.placement={placement}"],
                seed=seed, monkeypatch=monkeypatch)
    assert any(r["actor/grad_norm"] > 0 for r in one.steps()), f"seed {seed}: no gradient, nothing compared"
    assert_bitwise_equal(one, a)


# ---- vLLM -----------------------------------------------------------------------------------------
def _vllm_available() -> bool:
    try:
        from hybridrl.vllm_backend._import import vllm_available

        return vllm_available()
    except ImportError:
        return False


# head_dim 32: the smallest vLLM's CPU attention supports
VLLM = ["rollout.backend=vllm", "model.hidden_size=64", "model.intermediate_size=128"]


@pytest.mark.skipif(not _vllm_available(), reason="vLLM not installed (pip install 'hybridrl[vllm]')")
def test_vllm_staleness_zero(tmp_path: Path, monkeypatch) -> None:
    seed = _seeds.fresh_seed()
    sync = run_job(tmp_path, "sync", "single_turn", VLLM, seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", "single_turn", VLLM + ["trainer.mode=async", "pipeline.max_staleness=0"],
                seed=seed, monkeypatch=monkeypatch)
    assert_bitwise_equal(sync, a)


# ---- invariant 3: the staleness bound at random producer speeds -----------------------------------
def _draw(mode: str, task: str) -> tuple[dict, list[str]]:
    rng = random.Random(_seeds.fresh_seed())
    drawn = {"seed": _seeds.fresh_seed(), "rollout.step_latency_ms": round(rng.uniform(0, 20), 1),
             "pipeline.max_staleness": rng.choice([1, 2, 3]),
             "pipeline.placement": rng.choice(["colocated", "disaggregated"])}
    if task == "agent":
        drawn["env.latency_ms"] = round(rng.uniform(0, 50), 1)
    bound = 1 if mode == "one_step_off" else drawn["pipeline.max_staleness"]
    extra = [f"trainer.mode={mode}"] + [f"{k}={v}" for k, v in drawn.items() if k != "seed"]
    return {**drawn, "bound": bound}, extra


def _check_bound(run, drawn: dict) -> None:
    bound = drawn["bound"]
    for r in run.steps():
        assert r["async/staleness_max"] <= bound, (drawn, r["step"], r["async/staleness_max"])
        hist = {k: v for k, v in r.items() if k.startswith("async/staleness_hist_")}
        assert sorted(hist) == [f"async/staleness_hist_{d}" for d in range(bound + 1)], (drawn, sorted(hist))
        assert abs(sum(hist.values()) - 1.0) <= 1e-6, (drawn, r["step"], hist)
    worst = assert_started_within_bound(run, bound)
    print(f"drawn {drawn}: largest lag {worst}", file=sys.stderr)


BOUND_STEPS = 5  # a lag of 3 needs a sample started at step 1 and trained at step 4


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_staleness_bound(tmp_path: Path, monkeypatch, mode: str, task: str) -> None:
    """Invariant 3 at 1 rank, 5 RL steps (at 2 ranks: the overlapped ``test_dynamic_sampling_quota``
    runs, which draw their producer speeds the same way, 3 steps: lags up to 2)."""
    drawn, extra = _draw(mode, task)
    try:
        run = run_job(tmp_path, "bound", task, extra, seed=drawn["seed"], monkeypatch=monkeypatch, steps=BOUND_STEPS)
        _check_bound(run, drawn)
    except AssertionError as e:
        raise AssertionError(f"drawn {drawn}: {e}") from None


# ---- invariant 4: DAPO dynamic sampling fills its quota --------------------------------------------
REFILLS = 6
DAPO = ["algo.dapo.dynamic_sampling=true", f"algo.dapo.refill_rounds={REFILLS}"]


def _check_quota(run, what) -> dict:
    """Invariant 4 on every rank and step (the module docstring); returns totals for the report."""
    n = 4
    seen = {"refills": 0, "steps": 0}
    per_step: dict[int, list[tuple[float, int]]] = {}
    for rank in range(run.ranks):
        takes, updates = run.takes(rank), {e["step"]: e for e in run.updates(rank)}
        for e in takes:
            s, G, R = e["step"], e["groups_per_step"], int(e["metrics"]["batch/refill_rounds"])
            where = f"{what} rank {rank} step {s}"
            groups: dict[int, list[int]] = {}
            for b, g in enumerate(e["index"]):
                groups.setdefault(g, []).append(b)
            assert sorted(groups) == list(range((R + 1) * G)) and all(len(v) == n for v in groups.values()), \
                (where, R, sorted(groups))
            informative = [g for g in sorted(groups) if len({e["scores"][b] for b in groups[g]}) > 1]
            assert R <= REFILLS, where
            assert len(informative) >= G, f"{where}: {len(informative)} informative of quota {G} after {R} refills"
            if R > 0:
                assert sum(g < R * G for g in informative) < G, f"{where}: refilled with the quota already met"
            kept = len(informative) * n / len(e["index"])
            assert kept * (R + 1) >= 1, where
            want = sorted(tuple(e["rows"][b]) for g in informative[:G] for b in groups[g])
            got = sorted(tuple(r) for r in updates[s]["rows"])
            assert len(got) == G * n, f"{where}: trained {len(got)} rows, the quota is {G * n}"
            assert got == want, f"{where}: the trained rows are not those of the first {G} informative groups"
            per_step.setdefault(s, []).append((kept, R))
            seen["refills"] += R
            seen["steps"] += 1
    for r in run.steps():
        values = per_step[r["step"]]
        assert len(values) == run.ranks, what
        if run.ranks == 1:
            kept, rounds = values[0]
        else:
            kept, rounds = sum(v[0] for v in values) / run.ranks, sum(v[1] for v in values) / run.ranks
        assert r["batch/kept_fraction"] == kept, (what, r["step"], r["batch/kept_fraction"], values)
        assert r["batch/refill_rounds"] == rounds, (what, r["step"], r["batch/refill_rounds"], values)
    return seen


# the 2-rank single-turn runs of two modes carry LoRA / MoE with routing replay (sharded adapters,
# gathered publications; replayed routes per rank)
WITH_VARIANT = {("sync", "single_turn", 2): "lora", ("async", "single_turn", 2): "moe"}
DAPO_CASES = [(m, t, r, WITH_VARIANT.get((m, t, r), "plain"))
              for m in ("sync", "one_step_off", "async") for t in TASKS for r in (1, 2)]


@pytest.mark.parametrize("mode,task,ranks,variant", DAPO_CASES)
def test_dynamic_sampling_quota(tmp_path: Path, monkeypatch, mode: str, task: str, ranks: int, variant: str) -> None:
    """Invariant 4; the overlapped modes also draw their producer speeds and check invariant 3
    (refill rounds are admitted late in a step: the bound must hold for them too)."""
    if mode == "sync":
        drawn, extra = {"seed": _seeds.fresh_seed(), "bound": 0}, []
    else:
        drawn, extra = _draw(mode, task)
    try:
        extra = DAPO + VARIANTS.get(variant, []) + (extra or ["trainer.mode=sync"])
        run = run_job(tmp_path, "dapo", task, extra, seed=drawn["seed"], monkeypatch=monkeypatch, ranks=ranks)
        seen = _check_quota(run, run.label())
        if mode == "sync":
            assert_started_within_bound(run, 0)
        else:
            _check_bound(run, drawn)
    except AssertionError as e:
        raise AssertionError(f"drawn {drawn}: {e}") from None
    print(f"drawn {drawn}: {seen['refills']} refill rounds over {seen['steps']} rank-steps", file=sys.stderr)
