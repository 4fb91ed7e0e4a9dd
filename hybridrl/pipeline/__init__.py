"""Generation and training overlapped (``trainer.mode=one_step_off|async``).

    plan.py        which prompts and seeds each step trains on, drawn ahead in step order
    staleness.py   the admission rule (the staleness bound) and its per-step metrics
    producers.py   who generates: a thread on an in-process engine, or a worker process
    worker.py      the worker process: its own engine, requests in, finished samples out
    ray_producer.py  workers as Ray actors (launcher.name=ray), weights via the object store
    coordinator.py admission, the buffer of finished groups, weights out, checkpoint state

The trainer side is :class:`~hybridrl.pipeline.coordinator.Pipeline`; ``RLStep`` takes each
step's batch from it and publishes every update to it.
"""
