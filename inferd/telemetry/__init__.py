"""What gateway and replicas share to be observed: log format, tracing, metric buckets."""
from collections.abc import Iterable

from prometheus_client.core import Metric

LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)


def merged(families: Iterable[Metric]) -> list[Metric]:
    """Families of one name as one, with one HELP and one TYPE line as the text format wants (strict parsers such
    as promtool refuse a second), in the order first seen; the families given are left as they are."""
    out: dict[str, Metric] = {}
    for family in families:
        if (first := out.get(family.name)) is None:
            out[family.name] = family
        else:
            out[family.name] = both = Metric(first.name, first.documentation, first.type, first.unit)
            both.samples = first.samples + family.samples
    return list(out.values())
