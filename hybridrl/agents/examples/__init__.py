"""Example environments and tools classes (``env.name=hybridrl.agents.examples.<module>:<Class>``)."""
