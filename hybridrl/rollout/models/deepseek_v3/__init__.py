"""DeepSeek-V3: its config parsing (``config.py``: MLA dimensions, the grouped router) and
multi-head latent attention (``mla.py``); its decoder is ``models/decoder``, its experts ``models/moe``."""
