"""One running copy of a deployment: a runtime behind a small server that speaks the public protocol."""
