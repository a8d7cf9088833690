class BenchError(Exception):
    """A bench run cannot go on as configured; the message says what to change."""


class WorkloadError(BenchError):
    """The requested workload cannot be built (lengths, trace file, tokenizer)."""


class EndpointError(BenchError):
    """The target endpoint cannot be reached or does not answer as an OpenAI-compatible server."""


class ClientLagExceeded(BenchError):
    """The bench client's own event loop lagged beyond the stated bound; its timings cannot be trusted."""
