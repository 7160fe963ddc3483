"""`specdeploy serve OUT --triton-repo DIR`: write a Triton model repository, then run tritonserver on it.

With --no-launch it only writes the repository (for a stock tritonserver, e.g. NGC's container).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from ..runtime.errors import SpecDeployError


def run_triton(args) -> int:
    from .main import API_KEY_ENV, is_loopback
    from .triton_repo import write_repo

    if getattr(args, "ray", False):
        raise SpecDeployError("give --ray or --triton-repo, not both")
    if args.api_key:
        raise SpecDeployError("Triton has no API key: keep it on loopback or put an authenticating proxy in front")
    # options of the HTTP server this mode does not run: refused, not ignored (a key in the environment
    # would leave the user believing the ports were guarded)
    ignored = [flag for flag, given in (("--batch", getattr(args, "batch", None) is not None),
                                        ("--replicas", getattr(args, "replicas", None) is not None),
                                        ("--autoscale", bool(getattr(args, "autoscale", None))))
               if given]
    if ignored:
        raise SpecDeployError(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} not served under "
                              "--triton-repo (Triton runs the instances: --triton-instances, --pool-size)")
    if os.environ.get(API_KEY_ENV):
        print(f"warning: {API_KEY_ENV} is set, but Triton has no API key: its ports answer without one",
              file=sys.stderr, flush=True)
    for flag, port in (("--port", args.port), ("--grpc-port", args.grpc_port), ("--metrics-port", args.metrics_port)):
        if not 0 < port <= 65535:
            raise SpecDeployError(f"{flag} must be in [1, 65535], got {port}")
    repo = write_repo(args.out, args.triton_repo, name=args.model_name, instances=args.triton_instances,
                      pool_size=args.pool_size, queue_size=args.queue, queue_timeout=args.queue_timeout,
                      method=args.method, backend=args.backend, threads=args.threads,
                      python_env=None if args.no_python_env else "current")
    name = args.model_name or Path(args.out).resolve().name
    print(f"wrote Triton models '{name}' (infer) and '{name}_stream' (decoupled, streaming) to {repo}", flush=True)
    if args.no_launch:
        print(f"run: tritonserver --model-repository {Path(repo).resolve()}", flush=True)
        return 0
    from .triton_server import start

    if not is_loopback(args.host):
        print(f"warning: Triton on {args.host} answers anyone who can reach its ports", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="specdeploy-triton-") as work:
        proc = start(repo, Path(work), host=args.host, http_port=args.port, grpc_port=args.grpc_port,
                     metrics_port=args.metrics_port)
        print(f"tritonserver (pid {proc.pid}): HTTP {args.host}:{args.port}, gRPC {args.host}:{args.grpc_port}, "
              f"metrics {args.host}:{args.metrics_port}", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):  # Triton drains in-flight requests on SIGINT/SIGTERM
            signal.signal(sig, lambda signum, _: proc.send_signal(signum))
        return proc.wait()


def add_triton_arguments(s) -> None:
    t = s.add_argument_group("Triton Inference Server (--triton-repo)")
    t.add_argument("--triton-repo", type=Path, metavar="DIR", help="write a Triton model repository over the "
                   "export to DIR and serve it with tritonserver (--port is its HTTP port)")
    t.add_argument("--no-launch", action="store_true", help="only write the repository")
    t.add_argument("--grpc-port", type=int, default=8001)
    t.add_argument("--metrics-port", type=int, default=8002)
    t.add_argument("--triton-instances", type=int, default=1, help="Triton instances of the model, each a "
                   "Service of --pool-size workers")
    t.add_argument("--no-python-env", action="store_true", help="do not have Triton activate this virtual "
                   "environment for the models (the server's own Python has specdeploy installed)")
