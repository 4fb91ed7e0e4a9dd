"""DeepSeek-V4: config parsing (``config.py``), the model (``model.py``), its sliding and
compressed attention with the lightning indexer (``attention.py``, ``selection.py``),
hyper-connections (``hyper_connection.py``), its compressor / indexer state (``state.py``)
and its checkpoint layout (``checkpoint.py``)."""
