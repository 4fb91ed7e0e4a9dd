"""A rollout worker process: its own engine (and, for an agent, its own environment
pool), work in, finished samples and episodes out.

The trainer process talks to it over one pipe (commands in, results out) and refits it
through a shared-memory bucket (``refit/shm.py``: the same begin / load / finish bracket
and verifier as an in-process refit, a timeout on every message, the version the batch
source decided carried by the finish). Commands:

    ("add", [SampleWork | EpisodeWork, ...])   queue work
    ("refit",)   serve one refit; in-flight requests pause for it and continue with the
                 new weights (the engine's kv_on_refit)
    ("stop",)

Results: ``("ready", pid)`` once the engine is built, ``("finished", [RequestOutput |
Trajectory], idle_seconds)`` after every engine step that finished work, ``("error",
line)`` before dying of an exception. The worker exits when the trainer's end of the
pipe closes (the trainer died), so no worker outlives its trainer; its environment
workers follow it (their pipes close with it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WorkerSpec:
    """What a worker process needs to build the run's engine and work runner (all picklable)."""

    cfg: Any  # the run's Config (rollout.*, batch.*, env.*: build_engine / build_runner read it)
    hf_config: Any  # the policy's transformers config
    tokenizer: Any  # the policy's tokenizer (an agent's episodes render their turns with it)
    device: str
    longest_prompt: int
    threads: int  # torch CPU threads of the worker
    verify: bool  # refit.verify
    timeout_s: float  # pipeline.timeout_s
    adapter: Any = None  # LoRA adapter mode: the AdapterSpec the engine is built with (None: plain weights)


def build_worker_runner(spec: WorkerSpec):
    """The worker's engine and the work runner over it."""
    from hybridrl.pipeline.engines import build_engine, build_runner

    engine = build_engine(spec.cfg, spec.hf_config, device=torch.device(spec.device), ranks=1,
                          longest_prompt=spec.longest_prompt, lora=spec.adapter)
    return engine, build_runner(spec.cfg, engine, spec.tokenizer)


def worker_main(spec: WorkerSpec, conn, channel) -> None:
    """The process body (spawned): build the engine, then serve until told to stop."""
    from hybridrl.refit.shm import serve_refit

    torch.set_num_threads(spec.threads)
    runner = None
    try:
        engine, runner = build_worker_runner(spec)
        conn.send(("ready", os.getpid()))
        idle = 0.0
        while True:
            t0 = time.perf_counter()
            # idle: block for the next command (EOF when the trainer dies ends the loop);
            # busy: drain the commands already sent, then step
            wait = 0 if runner.busy() else spec.timeout_s
            while conn.poll(wait):
                wait = 0
                msg = conn.recv()
                if msg[0] == "add":
                    runner.submit(msg[1])
                elif msg[0] == "refit":
                    serve_refit(engine, channel, verify=spec.verify, timeout_s=spec.timeout_s)
                elif msg[0] == "stop":
                    return
            if not runner.busy():
                idle += time.perf_counter() - t0
                continue
            finished = runner.pump()
            if finished:
                conn.send(("finished", finished, idle))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
        except OSError:
            pass
        raise
    finally:
        if runner is not None:
            runner.close()
