"""A replica's Prometheus metrics, mirrored into Ray's metrics so every replica is exported.

Behind Ray Serve's proxy, `GET /metrics` reaches whichever replica the router picks. Ray
exports application metrics per node (each node's metrics agent, Prometheus format) and tags
those recorded through `ray.serve.metrics` with the deployment, replica and application. So
every few seconds each replica copies its own registry there: counters and histogram series
(`_bucket`, `_count`, `_sum`, all cumulative) as the increase since the last copy, gauges as
their value. Names keep the `specdeploy_` prefix (Ray adds `ray_`).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("specdeploy.serve")


class RayMetricsBridge:
    def __init__(self, registry, interval_s: float = 5.0):
        self.registry, self.interval_s = registry, interval_s
        self._ray_metrics: dict[str, object] = {}
        self._last: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specdeploy-ray-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.copy()  # the last counts, while the replica still exists

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.copy()
            except Exception:  # metrics must never take a replica down
                log.exception("copying metrics to Ray failed")

    def copy(self) -> None:
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                tags = {k: str(v) for k, v in sample.labels.items()}
                metric = self._metric(sample.name, family, tuple(sorted(tags)))
                if family.type == "gauge":
                    metric.set(sample.value, tags=tags)
                    continue
                key = (sample.name, tuple(sorted(tags.items())))
                delta = sample.value - self._last.get(key, 0.0)
                self._last[key] = sample.value
                if delta > 0:
                    metric.inc(delta, tags=tags)

    def _metric(self, name: str, family, tag_keys: tuple):
        metric = self._ray_metrics.get(name)
        if metric is None:
            from ray.serve import metrics

            kind = metrics.Gauge if family.type == "gauge" else metrics.Counter
            # Ray's exporter appends _total to counters itself.
            ray_name = name.removesuffix("_total")
            metric = self._ray_metrics[name] = kind(ray_name, description=family.documentation or name,
                                                    tag_keys=tag_keys)
        return metric
