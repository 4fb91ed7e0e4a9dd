"""A rollout worker process: its own engine, requests in, finished samples out.

The trainer process talks to it over one pipe (commands in, results out) and refits it
through a shared-memory bucket (``refit/shm.py``: the same begin / load / finish bracket
and verifier as an in-process refit, a timeout on every message). Commands:

    ("add", [(request_id, prompt_ids, SamplingParams), ...])   queue samples
    ("refit", version | None)   serve one refit; in-flight requests pause for it and
                                continue with the new weights (the engine's kv_on_refit);
                                a version aligns the engine's numbering (the first load)
    ("stop",)

Results: ``("ready", pid)`` once the engine is built, ``("finished", [RequestOutput],
idle_seconds)`` after every engine step that finished samples, ``("error", line)`` before
dying of an exception. The worker exits when the trainer's end of the pipe closes
(the trainer died), so no worker outlives its trainer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WorkerSpec:
    """What a worker process needs to build the run's engine (all picklable)."""

    cfg: Any  # the run's Config (rollout.*, batch.*, env.*: build_engine reads it)
    hf_config: Any  # the policy's transformers config
    device: str
    longest_prompt: int
    threads: int  # torch CPU threads of the worker
    step_latency_s: float  # rollout.step_latency_ms / 1000
    verify: bool  # refit.verify
    timeout_s: float  # pipeline.timeout_s
    adapter: Any = None  # LoRA adapter mode: the AdapterSpec the engine is built with (None: plain weights)


def worker_main(spec: WorkerSpec, conn, channel) -> None:
    """The process body (spawned): build the engine, then serve until told to stop."""
    from hybridrl.pipeline.engines import build_engine
    from hybridrl.refit.shm import serve_refit
    from hybridrl.rollout.backend import pad_step

    torch.set_num_threads(spec.threads)
    try:
        engine = build_engine(spec.cfg, spec.hf_config, device=torch.device(spec.device), ranks=1,
                              longest_prompt=spec.longest_prompt, lora=spec.adapter)
        conn.send(("ready", os.getpid()))
        idle = 0.0
        while True:
            t0 = time.perf_counter()
            # idle: block for the next command (EOF when the trainer dies ends the loop);
            # busy: drain the commands already sent, then step
            wait = 0 if engine.has_unfinished_requests() else spec.timeout_s
            while conn.poll(wait):
                wait = 0
                msg = conn.recv()
                if msg[0] == "add":
                    for rid, prompt, params in msg[1]:
                        engine.add_request(rid, prompt, params)
                elif msg[0] == "refit":
                    serve_refit(engine, channel, verify=spec.verify, timeout_s=spec.timeout_s)
                    if msg[1] is not None:
                        engine.load_state_dict({"weight_version": msg[1]})
                elif msg[0] == "stop":
                    return
            if not engine.has_unfinished_requests():
                idle += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            out = engine.step()
            pad_step(t0, spec.step_latency_s)
            if out.finished:
                conn.send(("finished", out.finished, idle))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
        except OSError:
            pass
        raise
