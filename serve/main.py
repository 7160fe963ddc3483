"""`specdeploy serve`: load the export once, then run uvicorn on the app."""

from __future__ import annotations

import logging

from ..runtime.errors import SpecDeployError


def run_server(args) -> int:
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise SpecDeployError(f"the server needs the serve extra ({exc.name} is missing): "
                              "pip install 'specdeploy[serve]'") from None
    from ..runtime.service import Service

    if not 0 <= args.port <= 65535:
        raise SpecDeployError(f"--port must be in [0, 65535], got {args.port}")
    from ..runtime.backends import use_shared_threads

    use_shared_threads(args.threads)  # our own process: one pool for every worker's sessions
    service = Service.load(args.out, pool_size=args.pool_size, queue_size=args.queue,
                           queue_timeout=args.queue_timeout, backend=args.backend, threads=args.threads,
                           method=args.method)
    app = create_app(service, model_name=args.model_name)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = app.state.server.model_name
    print(f"serving '{name}' from {args.out} on http://{args.host}:{args.port} "
          f"(methods {', '.join(service.methods)}; default {service.default_method}; "
          f"{service.pool.size} workers, queue {service.pool.queue_size})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                timeout_graceful_shutdown=5)
    return 0
