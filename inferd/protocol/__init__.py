"""The contract gateway and replica share: OpenAI wire types, the error shape, SSE, internal headers."""
