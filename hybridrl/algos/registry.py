"""Name → function registries for the algorithm family (advantage estimators, policy losses).

The loop looks every algorithm up by its config name (``algo.adv_estimator``,
``algo.policy_loss``) and calls it with keyword arguments; each function takes the
keywords it needs and ignores the rest (``**kwargs``), so one call site serves all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from hybridrl.did_you_mean import check_choice


class Registry(Mapping[str, Callable]):
    """A read-only mapping ``name -> function`` filled by the ``register`` decorator."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind  # "advantage estimator", for error messages
        self.config_key = config_key  # "algo.adv_estimator", for error messages
        self._fns: dict[str, Callable] = {}

    def register(self, *names: str, requires: tuple[str, ...] = ()):
        """Register a function under one or more names.

        ``requires`` lists the keyword inputs the function cannot work without (e.g.
        ``("index",)``, ``("values",)``); it is stored on the function as ``fn.requires``
        so the loop can decide what to compute (a critic, a greedy baseline) up front.
        """

        def deco(fn: Callable) -> Callable:
            for name in names:
                assert name not in self._fns, f"{self.kind} {name!r} registered twice"
                self._fns[name] = fn
            fn.requires = tuple(requires)
            return fn

        return deco

    def get_fn(self, name: str) -> Callable:
        check_choice(name, self._fns, self.config_key, self.kind)
        return self._fns[name]

    def __getitem__(self, name: str) -> Callable:
        return self.get_fn(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._fns)})"


ADV_ESTIMATORS = Registry("advantage estimator", "algo.advantage.estimator")
POLICY_LOSSES = Registry("policy loss", "algo.policy_loss.name")


def get_adv_estimator(name: str) -> Callable:
    """The advantage estimator registered as ``name`` (see ``ADV_ESTIMATORS``)."""
    return ADV_ESTIMATORS.get_fn(name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name`` (see ``POLICY_LOSSES``)."""
    return POLICY_LOSSES.get_fn(name)


__all__ = ["Registry", "ADV_ESTIMATORS", "POLICY_LOSSES", "get_adv_estimator", "get_policy_loss",
           "check_choice"]
