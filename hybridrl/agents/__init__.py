"""Multi-turn agents: environments and tools in the rollout, trained token-in/token-out.
Names resolve lazily so `import hybridrl` stays fast."""

from __future__ import annotations

from hybridrl.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "hybridrl.agents.types": ["EnvStep", "Environment"],
    "hybridrl.agents.env_pool": ["EnvPool"],
    "hybridrl.agents.tool_env": ["ToolEnvironment"],
    "hybridrl.agents.environment": ["load_environment", "environment_kind"],
    "hybridrl.agents.tool_parsers": ["get_parser", "register_parser", "ToolCall", "ParsedTurn", "MalformedCall"],
    "hybridrl.agents.chat_render": ["ChatRenderer", "check_template", "TemplateError"],
    "hybridrl.agents.episodes": ["EpisodeRunner", "EpisodeLimits"],
    "hybridrl.agents.trajectory": ["Trajectory", "trajectories_to_rollouts"],
})
