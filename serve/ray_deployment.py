"""Ray Serve: the OpenAI-compatible app as a deployment whose replicas each hold a Service.

    from ray import serve
    from specdeploy.serve.ray_deployment import specdeploy_app

    app = specdeploy_app("build/export/default", num_replicas=2)          # or autoscaling_config={...}
    serve.run(app, name="specdeploy", route_prefix="/")

or from a config file / the command line: `serve run specdeploy.serve.ray_deployment:app_builder
export_dir=build/export/default num_replicas=2`. Each replica loads the export once
(`Service.load`) and serves the same FastAPI app as `specdeploy serve` (routes, errors, limits,
streaming, chat templates); Ray Serve's proxy spreads requests over the replicas. Ray Serve's
replica health checks call `check_health` (a one-token generation while the replica is idle);
a replica being stopped finishes its requests within `graceful_shutdown_timeout_s`, then the
app's lifespan closes (chat-template processes) and Ray's metrics get the last counts. Resending
requests whose replica died is the proxy's job: see ray_failover.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from ray import serve

from ..runtime.pool import BusyError

log = logging.getLogger("specdeploy.serve")

REPLICA_HEADER = b"x-specdeploy-replica"
PROBE_EVERY_S = 30.0  # an idle replica generates one token at most this often in its health check


class _ReplicaScope:
    """What the app needs from Ray Serve's ASGI scope, and what it adds to the response.

    Ray Serve passes an application's route prefix as `root_path`, with the full path; the app
    dispatches and counts by its own paths (/v1/completions), so the prefix is taken off here.
    Every response names the replica that answered (`X-Specdeploy-Replica`): which one to look
    at in logs and metrics.
    """

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        prefix = scope.get("root_path", "")
        if prefix and scope["path"].startswith(prefix):
            path = scope["path"][len(prefix):] or "/"
            scope = {**scope, "root_path": "", "path": path, "raw_path": path.encode()}

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


@serve.ingress()  # the app is built per replica, after the export is loaded (__serve_build_asgi_app__)
class SpecDeployReplica:
    def __init__(self, export_dir: str, service_options: dict | None = None, app_options: dict | None = None,
                 metrics_interval_s: float = 5.0):
        import ray

        from ..runtime.backends import use_shared_threads
        from ..runtime.service import Service
        from .app import create_app
        from .limits import ServeLimits

        service_options = dict(service_options or {})
        app_options = dict(app_options or {})
        if not service_options.get("threads"):  # the CPUs Ray gave this replica, not the whole node's
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
            service_options["threads"] = max(1, round(cpus))
        use_shared_threads(service_options["threads"])  # this replica's process: one ORT pool for all its workers
        self.service = Service.load(export_dir, **service_options)
        limits = ServeLimits(**app_options.pop("limits", {}))
        self._app = create_app(self.service, limits=limits, **app_options)  # (`app` is Ray's property)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._app.add_middleware(_ReplicaScope, replica=self.replica)  # outermost
        self._bridge = None
        if metrics_interval_s:
            from .ray_metrics import RayMetricsBridge

            self._bridge = RayMetricsBridge(self._app.state.server.metrics.registry, metrics_interval_s)
        self._probed = 0.0
        log.info("replica %s serving %s (%d workers)", self.replica, Path(export_dir).name, self.service.pool.size)

    def __serve_build_asgi_app__(self):
        return self._app

    async def check_health(self) -> None:
        """Ray Serve calls this every `health_check_period_s`; raising marks the replica unhealthy and
        Ray Serve replaces it. An idle replica also proves its graphs still run (one token)."""
        status = self.service.status()
        if status["in_use"] or time.monotonic() - self._probed < PROBE_EVERY_S:
            return
        bos = self.service.meta.manifest.tokenizer.get("bos_token_id")
        prompt = [bos if isinstance(bos, int) else 0]
        try:
            await asyncio.to_thread(self.service.generate, prompt_ids=prompt, max_new_tokens=1, timeout=1.0)
        except BusyError:  # requests came in meanwhile: busy is healthy
            return
        except Exception as exc:
            raise RuntimeError(f"replica {self.replica}: a one-token generation failed: {exc}") from exc
        self._probed = time.monotonic()

    async def __del__(self):
        if getattr(self, "_bridge", None) is not None:  # the ASGI lifespan shutdown is the wrapper's own __del__
            self._bridge.close()
        await super().__del__()


def deployment_options(num_replicas: int | None = None, autoscaling_config: dict | None = None,
                       max_ongoing_requests: int | None = None, num_cpus: float = 1.0,
                       graceful_shutdown_timeout_s: float = 30.0, health_check_period_s: float = 10.0,
                       health_check_timeout_s: float = 30.0, pool_size: int = 1, queue_size: int = 8) -> dict:
    """Ray Serve options for the deployment. A replica takes at most what its own server admits
    (pool + queue), so Ray queues or routes the rest instead of the replica answering 429."""
    if (num_replicas is None) == (autoscaling_config is None):
        num_replicas = 1 if autoscaling_config is None else None
    options = dict(max_ongoing_requests=max_ongoing_requests or pool_size + queue_size,
                   ray_actor_options={"num_cpus": num_cpus},
                   graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
                   health_check_period_s=health_check_period_s, health_check_timeout_s=health_check_timeout_s)
    if autoscaling_config is not None:
        # Scale on busy workers: a replica with all its pool busy is at target.
        options["autoscaling_config"] = {"target_ongoing_requests": pool_size, **autoscaling_config}
    else:
        options["num_replicas"] = num_replicas
    return options


def specdeploy_app(export_dir: str | os.PathLike, *, name: str = "SpecDeploy", pool_size: int = 1,
                   queue_size: int = 8, queue_timeout: float = 30.0, method: str | None = None,
                   backend: str = "auto", threads: int | None = None, app_options: dict | None = None,
                   metrics_interval_s: float = 5.0, **options):
    """A bound Ray Serve application (pass it to `serve.run`).

    `options`: deployment_options() keywords (num_replicas or autoscaling_config, num_cpus, ...);
    `app_options`: create_app() keywords (model_name, api_key, allowed_origins, limits as a dict of
    ServeLimits fields). The export directory must be readable at the same path on every node.
    """
    export_dir = str(Path(export_dir).resolve())
    service_options = dict(pool_size=pool_size, queue_size=queue_size, queue_timeout=queue_timeout, method=method,
                           backend=backend, threads=threads)
    deployment = serve.deployment(SpecDeployReplica, name=name).options(
        **deployment_options(pool_size=pool_size, queue_size=queue_size, **options))
    return deployment.bind(export_dir, service_options, dict(app_options or {}), metrics_interval_s)


def app_builder(args: dict):
    """For `serve run specdeploy.serve.ray_deployment:app_builder export_dir=DIR [num_replicas=N]` and
    Ray Serve config files (`import_path` + `args`)."""
    args = dict(args)
    export_dir = args.pop("export_dir")
    numeric = {"num_replicas": int, "pool_size": int, "queue_size": int, "num_cpus": float,
               "queue_timeout": float, "threads": int}
    for key, kind in numeric.items():
        if isinstance(args.get(key), str):
            args[key] = kind(args[key])
    return specdeploy_app(export_dir, **args)
