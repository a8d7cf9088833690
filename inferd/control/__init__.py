"""The control plane: starting, watching and stopping replicas (never on a request's path)."""
