"""Multi-turn agents: environments and tools in the rollout, trained token-in/token-out.
Names resolve lazily so `import hybridrl` stays fast."""

from __future__ import annotations

from hybridrl.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "hybridrl.agents.types": ["EnvStep", "Environment"],
})
