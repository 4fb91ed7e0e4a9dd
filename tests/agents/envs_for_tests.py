"""Environments and tools for the agents tests, some misbehaving on purpose. The tests name
them by path (``tests/agents/envs_for_tests.py:Name``), so worker processes load this file
again; module level stays import-free and cheap for that reason."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field

from hybridrl.agents.tool_parsers import ParsedTurn, read_call


@dataclass
class History:
    """A dataclass in an environment's state: it must pickle by reference to this file."""

    guesses: list[int] = field(default_factory=list)


class GuessNumber:
    """Guess the row's answer (1..10); a hint after each wrong guess; 5 tries."""

    def reset(self, row: dict) -> list[dict]:
        self.target = int(row["answer"])
        self.history = History()
        return [{"role": "user", "content": "Guess my number (1-10)."}]

    def step(self, assistant_message: str):
        guess = int(assistant_message.strip())
        self.history.guesses.append(guess)
        tries = len(self.history.guesses)
        if guess == self.target:
            return [], 1.0, True, {"tries": tries}
        hint = "higher" if guess < self.target else "lower"
        return [{"role": "user", "content": hint}], 0.0, tries >= 5, {"tries": tries}


class Misbehaving:
    """An environment that misbehaves as the model's text says."""

    def reset(self, row: dict) -> list[dict]:
        if row.get("prompt") == "raise":
            raise RuntimeError("reset failed on purpose")
        self.turns = 0
        return [{"role": "user", "content": "go"}]

    def step(self, assistant_message: str):
        self.turns += 1
        if assistant_message == "raise":
            raise ValueError("step failed on purpose")
        if assistant_message == "hang":
            time.sleep(60)
        if assistant_message == "exit":
            os._exit(3)
        if assistant_message == "bad result":
            return "not a tuple"
        if assistant_message == "bad message":
            return [{"role": "user"}], 0.0, False, {}
        if assistant_message == "lock":
            self.lock = threading.Lock()  # cannot pickle
        return [{"role": "user", "content": f"turn {self.turns}"}], 0.5, False, {}


class Toolbox:
    """Tools that work, misbehave, and keep state (``increment``)."""

    def __init__(self):
        self.count = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def increment(self) -> int:
        """Add one to the counter and return it."""
        self.count += 1
        return self.count

    def fail(self, message: str) -> str:
        """Raise an error.

        Args:
            message: What the error says.
        """
        self.count += 100  # a failed call's changes must not stick
        raise ValueError(message)

    def hang(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke up"

    def shout(self, megabytes: int) -> str:
        """Print a lot to stdout.

        Args:
            megabytes: How much.
        """
        chunk = "x" * (1 << 20)
        for _ in range(megabytes):
            sys.stdout.write(chunk)
        sys.stdout.flush()
        return "done shouting"

    def crash(self, code: int) -> str:
        """Kill the process.

        Args:
            code: The exit code.
        """
        os._exit(code)

    def lookup(self, key: str, default: str | None = None) -> dict:
        """Look a key up.

        Args:
            key: The key.
            default: What to return when it is missing.
        """
        return {"key": key, "value": {"apple": "red"}.get(key, default), "count": self.count}


class NoDocstring:
    def add(self, a: int, b: int) -> int:
        return a + b


class NoTypeHint:
    def add(self, a, b: int) -> int:
        """Add.

        Args:
            a: The first.
            b: The second.
        """
        return a + b


class LocksInState:
    """A tools class whose state cannot travel."""

    def __init__(self):
        self.lock = threading.Lock()

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


class Empty:
    """Neither an Environment nor tools."""

    def _private(self):
        return None


def not_a_class():
    return None


def parse_call_lines(text: str) -> ParsedTurn:
    """A custom tool parser: each line ``CALL {json}`` is a call."""
    calls, rest = [], []
    for line in text.splitlines():
        if line.startswith("CALL "):
            calls.append(read_call(line[5:]))
        else:
            rest.append(line)
    return ParsedTurn(calls, "\n".join(rest).strip())


class Scripted:
    """An environment that plays the script in its row's answer for each episode of the group:
    ``answer["rewards"][j]`` the turn rewards of episode ``j`` (done after the last turn),
    ``answer["fail"][j]``: 0 = raise on reset, k >= 1 = raise on step k. ``row["episode"]`` is
    ``j``, the episode's index in its group (the test's pool wrapper adds it)."""

    def reset(self, row: dict) -> list[dict]:
        j = row["episode"]
        self.rewards, self.fail, self.turns = row["answer"]["rewards"][j], row["answer"]["fail"].get(j), 0
        if self.fail == 0:
            raise RuntimeError("reset failed on purpose")
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: str):
        self.turns += 1
        if self.fail == self.turns:
            raise ValueError("step failed on purpose")
        done = self.turns == len(self.rewards)
        return [] if done else [{"role": "user", "content": "go on"}], self.rewards[self.turns - 1], done, {}
