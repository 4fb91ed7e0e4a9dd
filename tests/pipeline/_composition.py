"""Helpers of the composition matrix (``test_composition.py``): the tiny jobs, a reward with
exact arithmetic, a per-rank recorder of what the batch source handed the trainer, and the
comparisons the invariants make.

This file is also the jobs' reward (``reward.functions=<this file>:score``), loaded by path
in every rank and rollout worker: its top level imports nothing heavy.

**The reward** (:func:`score`): ``1 + [sum of the response's code points = 0 mod 3]``, so 1 or 2
(an agent episode without a final answer gets 0: ``EpisodeGroups`` scores only answered
episodes). Like ``_hashed_reward.py`` it is a pure function of the text with spread inside
most groups (a group of 4 single-turn samples is flat with probability (2/3)^4 + (1/3)^4 = 0.21,
so DAPO's dynamic sampling drops some groups and refills), and its values are small
integers: any sum of them is exact in fp32 and every mean the runs log divides by a power of
two (16 rows in one process, 8 per rank and the ranks' means halved), so ``reward/mean`` of 2
ranks equals 1 process's exactly whenever the sampled rows are the same.

**The recorder** (:func:`install`): wraps ``Pipeline.take`` (each step's batch on this rank:
the source's own metrics before the ranks are averaged, every row's tokens, its reward and
group, the version each sample started at and the version that trains it) and
``Actor.update`` (the rows this rank trained), appending one JSON line per event to
``<dir>/rank<r>.jsonl``. A launched job gets it through :func:`rank_main`, which the elastic
launcher starts in place of hybridrl's own (``launch_local`` looks the name up when it
launches; spawned ranks import this module from the parent's ``sys.path``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "calculator_agent.yaml"
RECORD_ENV = "HYBRIDRL_TEST_COMPOSITION_RECORD"
STEPS = 3

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "rollout.n=4", "batch.prompts_per_step=4",
        "warm_start.batch_size=8", "data.train_size=64", "data.eval_size=4", "eval.k=0",
        f"trainer.total_steps={STEPS}", "trainer.eval_every=100", "trainer.threads=1", "pipeline.worker_threads=1",
        "checkpoint.every=0", "algo.kl.coef=0.02", "logging.progress=false", "logging.plot=false",
        "logging.tensorboard=false", f"reward.functions={Path(__file__).resolve()}:score"]
SINGLE_TURN = ["rollout.max_tokens=4", "warm_start.steps=3"]
# The calculator agent (examples/calculator_agent.yaml) shrunk: 2-digit operands, every
# demonstration calls the tool, 80 warm-start steps — enough that the policy opens its turns
# with <tool_call> and some calls parse (tool messages, second turns), while others are
# malformed (tool errors) or truncated. A tool call is ~40 characters of the chat char
# tokenizer, so a turn may sample 40 tokens (not 4-8: with 8 no episode ever reaches the tool).
AGENT = ["data.operand_digits=2", "data.teacher_tool_rate=1.0", "data.teacher_tool_rate_big=1.0",
         "warm_start.steps=80", "warm_start.lr=3e-3", "rollout.max_tokens=40", "env.workers=1", "env.max_turns=2"]
TASKS = ("single_turn", "agent")
# each run's own timing: never compared
TIMING_PREFIXES = ("time/", "perf/")
TIMING_SUFFIXES = ("_seconds", "_s")
SYNC_ONLY = {"refit/bytes"}  # the trainer's own engine refit: an overlapped run publishes to producers
LOSSES = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")


def score(response, answer, prompt):
    return 1.0 + float(sum(map(ord, response)) % 3 == 0)


score.hybridrl_trusted = True


# ---- the recorder (in every rank) ---------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _rows(ids, mask) -> list[list[int]]:
    ids, mask = ids.cpu(), mask.cpu().bool()
    return [r[m].tolist() for r, m in zip(ids, mask)]


def install(out_dir: str, setattr=setattr) -> None:  # noqa: A002 - pytest's monkeypatch.setattr fits here
    from hybridrl.pipeline.coordinator import Pipeline
    from hybridrl.trainer.actor import Actor

    take, update = Pipeline.take, Actor.update
    last = {"step": None}

    def write(entry: dict) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")

    def recording_take(pipe, model):
        step = pipe.next_step
        batch = take(pipe, model)
        sb, ro = batch.step_batch, batch.step_batch.rollouts
        mask = ro.response_mask.cpu().bool()
        started = []
        for tv, m in zip(ro.token_versions.cpu(), mask):  # a sample starts at its first token's version
            started.append(int(tv[m].min()) if bool(m.any()) else None)
        write({"kind": "take", "step": step, "groups_per_step": pipe.s.groups_per_step,
               "max_staleness": pipe.s.max_staleness, "refill_allowed": pipe.s.refill_rounds,
               "trained_version": pipe.version_of_step(step), "metrics": dict(batch.metrics),
               "rows": _rows(ro.input_ids, ro.attention_mask), "scores": sb.raw_scores.cpu().tolist(),
               "index": [int(i) for i in sb.index], "started": started})
        last["step"] = step
        return batch

    def recording_update(actor, batch, **kwargs):
        if last["step"] is not None:  # the RL updates (the warm start has its own optimizer loop)
            write({"kind": "update", "step": last["step"], "rows": _rows(batch["input_ids"], batch["attention_mask"])})
        return update(actor, batch, **kwargs)

    setattr(Pipeline, "take", recording_take)
    setattr(Actor, "update", recording_update)


def rank_main(config_yaml: str, error_dir: str) -> None:
    """A launched rank: the recorder, then hybridrl's own rank entry point."""
    from hybridrl.launch import elastic

    install(os.environ[RECORD_ENV])
    elastic.rank_main(config_yaml, error_dir)


# ---- running a job (in the test process; 2 ranks: launched from it) -----------------------------
class Run:
    """One finished job: its logged rows (metrics.jsonl) and every rank's record. (A plain
    class, not a dataclass: this file is also the reward, executed from its path by
    ``rewards/registry.py``, which does not register the module in ``sys.modules`` first, and
    a dataclass with string annotations looks its module up there.)"""

    def __init__(self, *, name: str, seed: int, overrides: list[str], ranks: int, dir: Path, rc: int,
                 seconds: float):
        self.name, self.seed, self.overrides, self.ranks, self.dir = name, seed, overrides, ranks, dir
        self.rc, self.seconds = rc, seconds
        self.rows: list[dict] = []  # metrics.jsonl
        self.records: list[list[dict]] = []  # per rank

    def label(self) -> str:
        return f"run {self.name!r} (seed {self.seed}, {self.ranks} rank(s), {self.seconds:.1f}s)"

    def steps(self) -> list[dict]:
        """The logged RL steps (not the warm start's eval row)."""
        return [r for r in self.rows if "reward/mean" in r]

    def compared(self) -> list[dict]:
        """Every logged row without its timing keys."""
        return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES) and not k.endswith(TIMING_SUFFIXES)}
                for r in self.rows]

    def takes(self, rank: int) -> list[dict]:
        return [e for e in self.records[rank] if e["kind"] == "take"]

    def updates(self, rank: int) -> list[dict]:
        return [e for e in self.records[rank] if e["kind"] == "update"]

    def step_rows(self, step: int) -> list[tuple]:
        """Every rank's sampled rows of ``step``, sorted (a multiset)."""
        return sorted(tuple(r) for rank in range(self.ranks) for e in self.takes(rank) if e["step"] == step
                      for r in e["rows"])

    def weights(self) -> dict:
        from safetensors.torch import load_file

        ck = self.dir / "checkpoint"
        adapter = ck / "adapter_model.safetensors"  # a LoRA run's checkpoint: the adapters
        return load_file(str(adapter if adapter.exists() else ck / "model.safetensors"))


def job(task: str, *extra: str) -> tuple[str | None, list[str]]:
    """(config file, overrides) of the tiny job of ``task``."""
    if task == "agent":
        return str(EXAMPLE), TINY + AGENT + list(extra)
    return None, TINY + SINGLE_TURN + list(extra)


def run_job(out: Path, name: str, task: str, extra: list[str], *, seed: int, monkeypatch, ranks: int = 1,
            steps: int = STEPS, expect_ok: bool = True) -> Run:
    """``hybridrl train`` in this process (``cli.main``); ``ranks=2`` launches 2 gloo ranks (real
    processes, FSDP2) from here. The recorder runs in every rank. The test process's torch
    threads and RNG are restored after."""
    import torch

    from hybridrl.cli import main
    from hybridrl.launch import elastic

    config, overrides = job(task, *extra, f"trainer.total_steps={steps}", f"trainer.seed={seed}",
                            f"trainer.output_dir={out}", f"trainer.run_name={name}")
    if ranks > 1:
        overrides.append(f"launcher.nproc_per_node={ranks}")
    record = out / f"{name}.record"
    argv = ["train"] + (["--config", config] if config else []) + overrides
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    t0 = time.perf_counter()
    with monkeypatch.context() as m:
        m.setenv(RECORD_ENV, str(record))
        m.delenv("HYBRIDRL_DEBUG", raising=False)
        if ranks == 1:
            install(str(record), m.setattr)
        else:
            m.setattr(elastic, "rank_main", rank_main)
        try:
            rc = main(argv)
        finally:
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
    run = Run(name=name, seed=seed, overrides=overrides, ranks=ranks, dir=out / name, rc=rc,
              seconds=time.perf_counter() - t0)
    print(f"{run.label()}: {' '.join(extra)}", file=sys.stderr)
    if expect_ok:
        assert rc == 0, f"{run.label()} failed (exit {rc}): {' '.join(argv)}"
        run.rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
        run.records = [[json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()]
                       for r in range(ranks)]
        assert len(run.steps()) == steps, f"{run.label()}: logged {len(run.steps())} of {steps} steps"
    return run


# ---- the invariants' comparisons -----------------------------------------------------------------
def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def assert_bitwise_equal(sync: Run, other: Run) -> None:
    """Invariant 1: ``other`` (async at max_staleness 0) logged every non-timing metric of
    ``sync`` bit for bit at every step (only its ``async/*`` keys are extra; ``refit/bytes``,
    the trainer's own engine refit, is sync's alone) and ended with the same weights."""
    import torch

    want, got = sync.compared(), other.compared()
    who = f"{other.label()} vs {sync.label()}"
    assert [r["step"] for r in got] == [r["step"] for r in want], who
    sync_keys, other_keys = ({k for r in rows for k in r} for rows in (want, got))
    assert all(k.startswith("async/") for k in other_keys - sync_keys), (who, sorted(other_keys - sync_keys))
    assert sync_keys - other_keys <= SYNC_ONLY, (who, sorted(sync_keys - other_keys))
    problems = [f"step {w['step']} {k}: {g.get(k, 'missing')!r} vs {w[k]!r}" for g, w in zip(got, want) for k in w
                if k not in SYNC_ONLY and not _same(g.get(k), w[k])]
    assert not problems, f"{who}: metrics differ: {problems[:6]}"
    a, b = sync.weights(), other.weights()
    assert a.keys() == b.keys(), who
    moved = [k for k in a if not torch.equal(a[k], b[k])]
    assert not moved, f"{who}: final weights differ: {moved[:4]}"


def assert_same_as_one_process(one: Run, many: Run, *, tolerance: float = 1e-5) -> list[str]:
    """Invariant 2: ``many`` ranks sampled the same rows as one process (checked at every
    step; a differing row is named, with its step, and ends the comparison: from there the
    runs train different data), rewards exactly equal and the losses within ``tolerance``
    (relative to max(1, |loss|)) at the steps with the same rows. Returns notes on what was
    not compared (empty when every step was)."""
    who = f"{many.label()} vs {one.label()}"
    a, b = one.steps(), many.steps()
    assert [r["step"] for r in a] == [r["step"] for r in b], who
    notes, compared = [], 0
    for ra, rb in zip(a, b):
        s = ra["step"]
        rows_a, rows_b = one.step_rows(s), many.step_rows(s)
        assert len(rows_a) == len(rows_b), f"{who}: step {s}: {len(rows_a)} vs {len(rows_b)} rows"
        if rows_a != rows_b:
            diff = sorted(set(rows_a) ^ set(rows_b))
            notes.append(f"step {s}: sampled rows differ ({len(diff)} rows, e.g. {diff[:1]}): a near-tie of the "
                         "sampling CDF under other summation orders; steps from here not compared")
            assert s > 1, f"{who}: step 1 sampled different rows from bitwise-equal weights: {notes[-1]}"
            break
        assert ra["reward/mean"] == rb["reward/mean"], \
            f"{who}: step {s} reward/mean {ra['reward/mean']!r} vs {rb['reward/mean']!r}"
        for k in LOSSES:
            if k in ra:
                assert abs(ra[k] - rb[k]) <= tolerance * max(1.0, abs(ra[k])), \
                    f"{who}: step {s} {k} {ra[k]!r} vs {rb[k]!r} (tolerance {tolerance})"
        compared += 1
    assert compared >= 1, who
    return notes


def assert_started_within_bound(run: Run, bound: int) -> int:
    """No sample trained more than ``bound`` versions after it started (recomputed from the
    tokens' versions on every rank, independently of the logged metrics); returns the
    largest lag seen."""
    worst = 0
    for rank in range(run.ranks):
        for e in run.takes(rank):
            lags = [e["trained_version"] - v for v in e["started"] if v is not None]
            assert lags and min(lags) >= 0, f"{run.label()} rank {rank} step {e['step']}: lags {lags}"
            assert max(lags) <= bound, (f"{run.label()} rank {rank} step {e['step']}: a sample started "
                                        f"{max(lags)} versions before it trained (bound {bound})")
            worst = max(worst, max(lags))
    return worst
