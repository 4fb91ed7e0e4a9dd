"""The calculator agent's tools class: one tool, exact integer addition.

``env.name=hybridrl.agents.examples.calculator:Calculator``. Its schema (what the chat
template tells the model) is built from the type hints and the docstring.
"""

from __future__ import annotations


class Calculator:
    """Stateless: one instance per episode, nothing to remember between calls."""

    def add(self, a: int, b: int) -> int:
        """Add two integers exactly.

        Args:
            a: the first addend
            b: the second addend
        """
        return a + b
