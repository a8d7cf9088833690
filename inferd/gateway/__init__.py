"""The provider gateway: who may run what, when, and what it costs (docs/architecture.md)."""
