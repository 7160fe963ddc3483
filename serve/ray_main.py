"""`specdeploy serve OUT --ray`: the same server as Ray Serve replicas.

Joins the cluster named by RAY_ADDRESS, or starts a local one (this machine only; bound to
loopback when --host is). Deploys ray_deployment.specdeploy_app with --replicas N or
--autoscale MIN,MAX, serves it on --host/--port through Ray Serve's proxy, and on Ctrl-C or
SIGTERM deletes the application (its replicas finish their requests first) and stops the
cluster it started.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading

from ..runtime.errors import SpecDeployError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
FAILOVER = "specdeploy.serve.ray_failover:proxy_middlewares"
# Ray's switch for single-machine clusters: "0" makes every node use the loopback address.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def parse_autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise SpecDeployError(f"--autoscale takes MIN,MAX (two integers), got {text!r}") from None
    if not 0 <= low <= high or high < 1:
        raise SpecDeployError(f"--autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return low, high


def parse_delays(text: str) -> tuple[float, float]:
    try:
        up, down = (float(part) for part in text.split(","))
    except ValueError:
        raise SpecDeployError(f"--autoscale-delays takes UP,DOWN seconds, got {text!r}") from None
    if not (0 <= up < math.inf and 0 <= down < math.inf):  # NaN fails both comparisons
        raise SpecDeployError(f"--autoscale-delays must be finite seconds >= 0, got {text!r}")
    return up, down


def scaling(args) -> dict:
    """num_replicas or autoscaling_config for deployment_options(), from the command line."""
    if args.replicas is not None and args.autoscale:
        raise SpecDeployError("give --replicas N or --autoscale MIN,MAX, not both")
    if args.autoscale:
        low, high = parse_autoscale(args.autoscale)
        up, down = parse_delays(args.autoscale_delays)
        # Ray averages load over look_back_period_s: no longer than the upscale delay, so one burst
        # is enough to add a replica.
        return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
                                       "upscale_delay_s": up, "downscale_delay_s": down,
                                       "look_back_period_s": max(1.0, min(up, 30.0)), "metrics_interval_s": 1.0}}
    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        raise SpecDeployError(f"--replicas must be >= 1, got {replicas}")
    return {"num_replicas": replicas}


def run_ray(args, limits, api_key: str | None, origins: list[str]) -> int:
    from .main import is_loopback

    options = scaling(args)
    if not 0 < args.replica_cpus < math.inf:  # NaN fails the comparison
        raise SpecDeployError(f"--replica-cpus must be a finite number > 0, got {args.replica_cpus}")
    address = os.environ.get("RAY_ADDRESS")
    if not address:  # read by Ray at import: set them first
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a cluster we start reports nothing anywhere
        if is_loopback(args.host):  # keep the whole cluster on loopback (Ray otherwise uses the machine's IP)
            os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecDeployError("--ray needs the ray extra: pip install 'specdeploy[ray]'") from None
    from .ray_deployment import specdeploy_app

    if address:
        if os.environ.get(PROXY_CALLBACK_ENV) != FAILOVER:
            print(f"note: requests whose replica dies are resent only if the cluster's nodes were started with "
                  f"{PROXY_CALLBACK_ENV}={FAILOVER}", file=sys.stderr, flush=True)
        ray.init(address=address, log_to_driver=False)
    else:
        os.environ[PROXY_CALLBACK_ENV] = FAILOVER  # the nodes we start pass it on to Ray Serve's proxies
        # "local": a cluster of our own. Without an address Ray joins the machine's latest live cluster (another
        # user's or a test's), deploys into its Serve instance (whose HTTP port ignores ours) and, on stop,
        # serve.shutdown() would have shut that instance down.
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    name = args.model_name or args.out.resolve().name
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = specdeploy_app(args.out, pool_size=args.pool_size, queue_size=args.queue,
                             queue_timeout=args.queue_timeout, method=args.method, backend=args.backend,
                             threads=args.threads, num_cpus=args.replica_cpus,
                             app_options=dict(model_name=args.model_name, api_key=api_key, allowed_origins=origins,
                                              limits=dataclasses.asdict(limits)), **options)
        try:
            serve.run(app, name=name, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # Ray's message names the deployment; the replica's error is in its status
            reason = _deploy_error(serve, name) or exc
            raise SpecDeployError(f"Ray Serve could not start the replicas: {reason}") from None
        scale = (f"{options['num_replicas']} replicas" if "num_replicas" in options else
                 "autoscaling {min_replicas}..{max_replicas} replicas".format(**options["autoscaling_config"]))
        print(f"serving '{name}' from {args.out} on http://{args.host}:{args.port} with Ray Serve ({scale}, "
              f"{args.pool_size} workers and a queue of {args.queue} each; cluster "
              f"{address or 'started here'}; API key {'required' if api_key else 'not set'})", flush=True)
        stop.wait()
    finally:
        print("stopping: replicas finish their requests first", file=sys.stderr, flush=True)
        try:
            serve.delete(name)
        finally:
            if not address:
                serve.shutdown()
            ray.shutdown()
    return 0


def _deploy_error(serve, name: str) -> str:
    try:
        app = serve.status().applications[name]
        messages = [d.message for d in app.deployments.values() if d.message]
    except Exception:
        return ""
    return "\n".join(m.strip().splitlines()[-1] for m in messages)  # a traceback's last line is its error


def add_ray_arguments(s) -> None:
    r = s.add_argument_group("Ray Serve (--ray)")
    r.add_argument("--ray", action="store_true", help="serve as Ray Serve replicas (cluster: $RAY_ADDRESS, else "
                   "a local one); needs the ray extra")
    r.add_argument("--replicas", type=int, help="replicas, each a Service of --pool-size workers (default 1)")
    r.add_argument("--autoscale", metavar="MIN,MAX", help="let Ray Serve scale between MIN and MAX replicas, "
                   "targeting --pool-size requests in flight per replica")
    r.add_argument("--autoscale-delays", metavar="UP,DOWN", default="10,120",
                   help="seconds of sustained load before adding a replica, of low load before removing one")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (and its "
                   "ONNX Runtime threads unless --threads)")
