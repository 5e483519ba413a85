"""A stand-in for pb_utils' metric API (MetricFamily / Metric) that keeps every family and value."""

from __future__ import annotations


class _Metric:
    def __init__(self, family, labels: dict):
        self.family, self.labels, self.value, self.updates = family, labels, 0.0, 0

    def increment(self, value: float) -> None:
        assert value >= 0, "counters only grow"
        self.value += value
        self.updates += 1

    def set(self, value: float) -> None:
        self.value = value
        self.updates += 1


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        MetricStub.families[name] = self

    def Metric(self, labels: dict, buckets=None):  # noqa: N802 (pb_utils' spelling)
        metric = _Metric(self, labels)
        self.metrics.append(metric)
        return metric


class MetricStub:
    """Pass as `pb_utils`; `families` maps every family name created to its metrics."""

    families: dict[str, _Family] = {}
    MetricFamily = _Family

    @classmethod
    def reset(cls) -> type[MetricStub]:
        cls.families = {}
        return cls

    @classmethod
    def value(cls, name: str, **labels) -> float:
        """The value of the series `name` with exactly these labels (0 when never created)."""
        family = cls.families[name]
        return sum(m.value for m in family.metrics if m.labels == labels)
