"""OpenAI-compatible HTTP server over a runtime Service (`specdeploy serve`).

Needs the `serve` extra (fastapi, uvicorn, prometheus-client, jinja2). Import
`specdeploy.serve.app.create_app` to mount the API inside your own ASGI process.
"""
