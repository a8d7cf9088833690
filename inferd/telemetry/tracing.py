"""OpenTelemetry traces (GenAI semantic conventions), exported over OTLP/HTTP when an endpoint is set."""
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def make_tracer(service: str, otlp_endpoint: str | None = None,
                exporter: SpanExporter | None = None) -> tuple[trace.Tracer, TracerProvider | None]:
    """A no-op tracer unless an OTLP endpoint (…:4318) or an exporter is given."""
    if otlp_endpoint is None and exporter is None:
        return trace.NoOpTracer(), None
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("inferd"), provider
