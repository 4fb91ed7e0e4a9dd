"""The agents tests' shared tokenizer and tiny model (built once per session)."""

from __future__ import annotations

import pytest

from tests.agents.qwen_chat import CHATML, qwen_tokenizer
from tests.agents.tiny_agent import tiny_qwen


@pytest.fixture(scope="session")
def tok():
    return qwen_tokenizer(CHATML)


@pytest.fixture(scope="session")
def model(tok):
    return tiny_qwen(tok)
