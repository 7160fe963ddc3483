"""`specdeploy serve`: load the export once, then run uvicorn on the app."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

from ..runtime.errors import SpecDeployError
from .limits import CONNECTION_HEADROOM

API_KEY_ENV = "SPECDEPLOY_API_KEY"
# A browser's Origin header: scheme://host[:port], the host a name, an IPv4 address or a bracketed IPv6 one.
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
GRACEFUL_SHUTDOWN_S = 5.0  # uvicorn's wait for responses to end (aborted at once: only slow readers need it)
WORKER_STOP_S = 30.0  # then for every worker to leave ONNX Runtime (cancelled: within one step)

log = logging.getLogger("specdeploy.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything says it serves (uvicorn would start the app, then fail
    to bind): a port in use or an address not of this machine is one clear error. uvicorn then serves
    on this socket, so no other process can take the port in between."""
    address = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse TIME_WAIT ports
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise SpecDeployError(f"cannot listen on {host}:{port}: {reason[:1].lower()}{reason[1:]}") from None
    return sock


def _warn_if_open(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        print(f"warning: serving on {host}, beyond this machine, without an API key: anyone who can reach "
              f"the port can run generations (set --api-key or {API_KEY_ENV})", file=sys.stderr, flush=True)


def run_server(args) -> int:
    if getattr(args, "triton_repo", None):  # Triton serves its own protocols: no FastAPI app
        from .triton_main import run_triton

        return run_triton(args)
    try:  # the serve extra, checked before anything else (_serve imports them)
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as exc:
        raise SpecDeployError(f"the server needs the serve extra ({exc.name} is missing): "
                              "pip install 'specdeploy[serve]'") from None
    from .limits import ServeLimits

    if not 0 <= args.port <= 65535:
        raise SpecDeployError(f"--port must be in [0, 65535], got {args.port}")
    limits = ServeLimits(max_model_len=args.max_model_len, max_tokens=args.max_tokens,
                         max_concurrent_requests=args.max_concurrent_requests, max_connections=args.max_connections,
                         max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                         body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                         max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                         request_timeout_s=args.request_timeout or None, template_timeout_s=args.template_timeout,
                         tokenize_timeout_s=args.tokenize_timeout)
    if args.api_key is not None and not args.api_key.strip():  # an empty key would have served without one
        raise SpecDeployError("--api-key is empty: give a key, or leave the option out to serve without one")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    origins = [o.strip() for item in args.allowed_origins or [] for o in item.split(",") if o.strip()]
    if "*" in origins:
        raise SpecDeployError("--allowed-origins takes explicit origins (https://app.example.com), not '*'")
    for origin in origins:  # a browser sends scheme://host[:port]: anything else would never match one
        if not ORIGIN.fullmatch(origin):
            raise SpecDeployError(f"--allowed-origins: {origin!r} is not a web origin (scheme://host[:port], "
                                  "e.g. https://app.example.com, no path)")
    ray_only = getattr(args, "replicas", None) is not None or getattr(args, "autoscale", None)
    if ray_only and not getattr(args, "ray", False):
        raise SpecDeployError("--replicas and --autoscale are Ray Serve options: add --ray")
    if getattr(args, "ray", False):
        from ..runtime.manifest import load_manifest
        from .ray_main import run_ray

        # Bad input fails here, once, rather than in every replica.
        limits.model_len(load_manifest(args.out, verify_checksums=False).max_context)
        _warn_if_open(args.host, api_key)
        return run_ray(args, limits, api_key, origins)
    sock = listen(args.host, args.port)  # before loading: a busy port fails at once
    try:
        return _serve(args, sock, limits, api_key, origins)
    finally:
        sock.close()  # on every path: a failed load leaves no socket bound behind


def _serve(args, sock, limits, api_key, origins) -> int:
    import uvicorn

    from ..runtime.backends import use_shared_threads
    from ..runtime.service import Service
    from .app import create_app
    from .header_limit import with_head_timeout
    from .security import uvicorn_limit

    _warn_if_open(args.host, api_key)
    port = sock.getsockname()[1]  # --port 0: the one the OS chose
    use_shared_threads(args.threads)  # our own process: one pool for every worker's sessions
    service = Service.load(args.out, pool_size=args.pool_size, queue_size=args.queue,
                           queue_timeout=args.queue_timeout, backend=args.backend, threads=args.threads,
                           method=args.method, batch=args.batch)
    app = create_app(service, model_name=args.model_name, limits=limits, api_key=api_key, allowed_origins=origins)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server = app.state.server
    host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host  # an IPv6 address in a URL
    print(f"serving '{server.model_name}' from {args.out} on http://{host}:{port} "
          f"(methods {', '.join(service.methods)}; default {service.default_method}; "
          f"{service.pool.size} workers, queue {service.pool.queue_size}, "
          f"{server.admission.limit} requests in flight, context {server.model_len}; "
          f"API key {'required' if api_key else 'not set'})", flush=True)
    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            http=with_head_timeout(limits.header_timeout_s),
                            h11_max_incomplete_event_size=limits.max_header_bytes,
                            limit_concurrency=uvicorn_limit(server.connection_limit))  # the app answers first, in JSON
    served = _uvicorn_server(config, server)
    try:
        served.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal (as uvicorn.run, quietly)
        pass
    if threading.current_thread() is threading.main_thread():
        # Shut down: one more Ctrl-C (pressed several times) must not turn this exit into a KeyboardInterrupt
        # or, once the interpreter finalizes (it restores SIG_DFL), into a death by SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not served.started:
        raise SpecDeployError("the server failed to start (see the log above)")
    if not served.workers_stopped:
        # A thread still inside ONNX Runtime would abort the process (SIGABRT) when it returns into an
        # interpreter that is finalizing (see Service.close): leave without finalizing.
        log.error("a generation did not stop within %g s of the shutdown; exiting without waiting for it",
                  WORKER_STOP_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def _uvicorn_server(config, server):
    """uvicorn's server, with our generations ended when it shuts down (SIGINT, SIGTERM): new requests get
    503 and those in flight end at once (a JSON 503; a stream's in-band error, then [DONE]), so its wait
    for the connections is short; then it waits for the workers to leave ONNX Runtime before the
    process exits (SIGINT: run() returns and the interpreter finalizes; SIGTERM: uvicorn re-raises it)."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        def __init__(self, config, server):
            super().__init__(config)
            self.app_server = server
            self.workers_stopped = True

        def handle_exit(self, sig, frame) -> None:
            repeated = self.should_exit
            super().handle_exit(sig, frame)  # a second SIGINT: force_exit (no wait for slow clients)
            captured = getattr(self, "_captured_signals", None)
            if repeated and captured:  # uvicorn re-raises each one after shutdown: a second KeyboardInterrupt
                captured.pop()  # escaped `except KeyboardInterrupt` (exit -2, with a traceback)

        async def shutdown(self, sockets=None) -> None:
            self.app_server.begin_shutdown()
            try:
                await super().shutdown(sockets)
                if self.force_exit:  # uvicorn skips the app's shutdown then: its task, cancelled later, logs a
                    await self.lifespan.shutdown()  # traceback; ours is quick (it stops the template processes)
            finally:
                self.workers_stopped = await asyncio.to_thread(self.app_server.finish_shutdown, WORKER_STOP_S)

    return Uvicorn(config, server)


def add_serve_arguments(s) -> None:
    """The `serve` subcommand's options (cli.py builds the parser)."""
    s.add_argument("out", type=Path, help="export directory")
    s.add_argument("--method", help="default method (a request may choose another with 'method'); default auto: "
                   "the export's recommended one, draft+prompt-lookup where it has a draft model")
    s.add_argument("--host", default="127.0.0.1", help="bind address; beyond loopback, set --api-key")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--pool-size", type=int, default=1, help="concurrent requests (one export instance each)")
    s.add_argument("--batch", type=int, help="serve up to N requests as rows of one batched target graph "
                   "(continuous batching, ort-cpu; replaces --pool-size); float32 exports write that graph; an "
                   "export made before it adds it with: python -m specdeploy.export.batched_graph OUT")
    s.add_argument("--queue", type=int, default=8, help="requests that may wait for a worker; beyond: 429")
    s.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait; then 429")
    s.add_argument("--backend", default="auto", help="ort-cpu | ort-cuda | ort-trt | trt | auto")
    from ..runtime.backends.ort import thread_count

    s.add_argument("--threads", type=thread_count, help="ONNX Runtime threads, one pool shared by all workers "
                   "(default: the physical cores)")
    s.add_argument("--model-name", help="model id clients use (default: the export directory's name)")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                   "prefer the variable: arguments show in process lists)")
    s.add_argument("--allowed-origins", action="append", metavar="ORIGIN[,ORIGIN...]",
                   help="web origins allowed to call the API from a browser (CORS); default none")
    s.add_argument("--max-model-len", type=int, help="prompt + completion tokens (default and maximum: the "
                   "export's max context)")
    s.add_argument("--max-tokens", type=int, help="most completion tokens a request may ask for (default: what "
                   "the context leaves)")
    s.add_argument("--max-concurrent-requests", type=int, help="generation requests admitted at once, parsing "
                   "and queued included; beyond: 429 (default: pool size + queue)")
    s.add_argument("--max-connections", type=int, help="HTTP requests in progress (health and metrics "
                   f"aside); beyond: 503 (default: max concurrent requests + {CONNECTION_HEADROOM})")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size; beyond: 413")
    s.add_argument("--max-header-bytes", type=int, default=64 << 10, help="request line and headers; beyond: 431")
    s.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body; then 408")
    s.add_argument("--header-timeout", type=float, default=10.0, help="seconds a connection has to send a whole "
                   "request head (from opening, or from its first byte on a kept-alive connection); then 408, or "
                   "closed if it sent nothing")
    s.add_argument("--max-stop", type=int, default=16, help="stop strings per request")
    s.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from arrival to the last token, queue included; then 504 (0: no limit)")
    s.add_argument("--template-timeout", type=float, default=2.0, help="seconds to render one chat prompt")
    s.add_argument("--tokenize-timeout", type=float, default=10.0, help="seconds to tokenize one prompt; then 500")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="uvicorn's access log (request ids are logged anyway)")
    from .ray_main import add_ray_arguments
    from .triton_main import add_triton_arguments

    add_ray_arguments(s)
    add_triton_arguments(s)
