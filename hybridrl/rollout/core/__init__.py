"""The engine core: requests scheduled into a running batch (``scheduler.py``,
``running_batch.py``, ``prefix_cache.py``), the KV cache and its memory plan
(``kv_cache.py``, ``memory.py``), and the device work (``model_runner.py``,
``cuda_graph.py``). The model itself is ``rollout/models/``, its layers ``rollout/layers/``."""
