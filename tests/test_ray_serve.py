"""Ray Serve end to end, on loopback: a two-node Ray cluster on this machine (ray.cluster_utils.Cluster),
the real proxy and replicas, the official `openai` client.

Three applications share the cluster's Ray Serve proxy:
- `/micro`: the Python entry point (ray_deployment.specdeploy_app) over the micro export, two replicas;
- `/`: `specdeploy serve OUT --ray --replicas 2`, joining the cluster through RAY_ADDRESS, over the
  micro family exported with a 4096-token context, so that a generation outlives a replica kill;
- `/auto`: autoscaling between one and two replicas, configured as `--autoscale 1,2` configures it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from specdeploy.serve.ray_main import FAILOVER, LOOPBACK_ENV, PROXY_CALLBACK_ENV, scaling

RAY_ENV = {LOOPBACK_ENV: "0",  # every node on 127.0.0.1, never the machine's own address
           "RAY_USAGE_STATS_ENABLED": "0",
           PROXY_CALLBACK_ENV: FAILOVER}  # inherited by the nodes, so by Ray Serve's proxies
os.environ.update(RAY_ENV)  # before Ray is imported: it reads them at import time

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the ray extra: pip install -e '.[ray]' "
                          "(or make serve-deps)")
serve = pytest.importorskip("ray.serve")

from conftest import REPO  # noqa: E402 (after importorskip: skip the module before importing)
from serve_util import free_port, interrupt  # noqa: E402

LONG_CONTEXT = 4096
PROMPTS = ["def main():", "import numpy as np\n", "class Node:\n    def __init__(self"]


def wait_for(condition, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def running_replicas(app: str) -> int:
    deployments = serve.status().applications[app].deployments
    return sum(d.replica_states.get("RUNNING", 0) for d in deployments.values())


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = None
    try:
        # Two CPUs of Ray's accounting per node (replicas take 0.5): the machine has 2 real cores.
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                                "object_store_memory": 100 << 20})
        nodes.add_node(num_cpus=2, object_store_memory=100 << 20)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield Namespace(address=nodes.address, url=f"http://127.0.0.1:{port}", port=port)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if nodes is not None:
                nodes.shutdown()


@pytest.fixture(scope="module")
def micro_app(cluster, micro_export):
    from specdeploy.serve.ray_deployment import specdeploy_app

    app = specdeploy_app(micro_export, num_replicas=2, num_cpus=0.5, app_options={"model_name": "micro"})
    serve.run(app, name="micro", route_prefix="/micro")
    yield f"{cluster.url}/micro"
    serve.delete("micro")


@pytest.fixture(scope="module")
def long_export(micro_family, tmp_path_factory) -> Path:
    """The micro target with a 4096-token context: a generation lasts seconds, long enough to kill its replica."""
    from specdeploy.export.exporter import export_all

    root = tmp_path_factory.mktemp("ray_long")
    (root / "target").mkdir()
    for item in (micro_family / "target").iterdir():
        (root / "target" / item.name).symlink_to(item)
    config = json.loads((micro_family / "target" / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT  # RoPE extends; the text is nonsense, the server does not care
    (root / "target" / "config.json").unlink()
    (root / "target" / "config.json").write_text(json.dumps(config))
    (root / "config.yaml").write_text(f"max_context: {LONG_CONTEXT}\n")
    return export_all(root / "target", root / "long", config=root / "config.yaml", progress=lambda msg: None)


@pytest.fixture(scope="module")
def cli_server(cluster, long_export, tmp_path_factory):
    """`specdeploy serve OUT --ray --replicas 2` joining the cluster; stopped by the last test (SIGINT)."""
    log_path = tmp_path_factory.mktemp("ray_cli") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "specdeploy.cli", "serve", str(long_export), "--ray",
                             "--replicas", "2", "--replica-cpus", "0.5", "--port", str(cluster.port),
                             "--model-name", "long", "--log-level", "warning"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": cluster.address})
    try:
        wait_for(lambda: proc.poll() is not None or "serving 'long'" in log_path.read_text(), 240,
                 "specdeploy serve --ray starting")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        yield Namespace(proc=proc, url=cluster.url, log=log_path)
    finally:
        interrupt(proc, 60)
        log.close()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def runtime_text(export: Path, prompt: str, max_tokens: int) -> str:
    from specdeploy.runtime import Service

    svc = Service.load(export, warmup=False)
    return svc.generate(prompt, max_new_tokens=max_tokens, temperature=0).text


# -- /micro: the Python entry point ------------------------------------------------------------

def test_two_replicas_on_two_nodes_answer_greedy_like_the_runtime(micro_app, micro_export):
    from specdeploy.runtime import Service

    svc = Service.load(micro_export, warmup=False)
    expected = {p: svc.generate(p, max_new_tokens=24, temperature=0).text for p in PROMPTS}
    c = client(micro_app)

    def ask(prompt):
        raw = c.completions.with_raw_response.create(model="micro", prompt=prompt, max_tokens=24, temperature=0)
        return prompt, raw.parse().choices[0].text, raw.headers["x-specdeploy-replica"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, PROMPTS * 4))
    for prompt, text, _ in answers:
        assert text == expected[prompt]
    assert len({replica for *_, replica in answers}) == 2, "both replicas served"

    replicas = {a["ActorID"]: a for a in ray._private.state.actors().values()  # private, but the only list
                if a.get("Name", "").startswith("SERVE_REPLICA::micro#") and a.get("State") == "ALIVE"}
    assert len(replicas) == 2
    assert len({a["Address"]["NodeID"] for a in replicas.values()}) == 2, "one replica per node"


def test_streaming_through_the_proxy(micro_app, micro_export):
    expected = runtime_text(micro_export, PROMPTS[0], 24)
    chunks = list(client(micro_app).completions.create(model="micro", prompt=PROMPTS[0], max_tokens=24,
                                                       temperature=0, stream=True))
    assert len(chunks) > 2, "tokens arrive as separate events"
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_health_checks_and_per_replica_metrics(micro_app, cluster):
    health = httpx.get(f"{micro_app}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.headers["x-specdeploy-replica"]
    handle = serve.get_deployment_handle("SpecDeploy", app_name="micro")
    assert handle.check_health.remote().result(timeout_s=30) is None  # what Ray Serve's health check calls
    status = serve.status().applications["micro"].deployments["SpecDeploy"].status
    assert getattr(status, "value", status) == "HEALTHY"

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]

    def replicas_exported():
        seen = set()
        for port in ports:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("ray_specdeploy_requests") and 'application="micro"' in line:
                    seen.add(line.split('replica="', 1)[1].split('"', 1)[0])
        return seen if len(seen) >= 2 else None

    assert len(wait_for(replicas_exported, 60, "both replicas' request counts in Ray's metrics", every=2)) == 2


def test_without_ray_address_it_starts_a_cluster_of_its_own(micro_app, micro_export, tmp_path):
    """Without RAY_ADDRESS, `serve --ray` joined the machine's latest live cluster (this module's): it deployed
    into that cluster's Serve instance, whose proxy ignored its port, and on SIGINT shut that instance down."""
    log_path, port = tmp_path / "own.log", free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specdeploy.cli", "serve", str(micro_export), "--ray",
                                 "--replicas", "1", "--replica-cpus", "0.5", "--port", str(port),
                                 "--model-name", "own", "--log-level", "warning"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(lambda: proc.poll() is not None or "serving 'own'" in log_path.read_text(), 240,
                     "specdeploy serve --ray starting")
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert "cluster started here" in log_path.read_text()
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # its own port
            assert "own" not in serve.status().applications  # not deployed into this module's cluster
        finally:
            interrupt(proc, 90)
    # this module's Serve instance is still up and answering
    assert httpx.get(f"{micro_app}/health", timeout=30).status_code == 200


# -- /: `specdeploy serve --ray`, a replica killed under load, graceful shutdown ---------------

def test_cli_replicas_answer_like_the_runtime(cli_server, long_export):
    text = client(cli_server.url).completions.create(model="long", prompt=PROMPTS[1], max_tokens=24,
                                                     temperature=0).choices[0].text
    assert text == runtime_text(long_export, PROMPTS[1], 24)


def test_killing_a_replica_loses_no_request(cli_server):
    """Non-streaming requests on the dead replica are resent (ray_failover.py); a stream it was writing
    ends with an error event and [DONE]."""
    body = {"model": "long", "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    long_stream = {**body, "max_tokens": LONG_CONTEXT - 100, "stream": True}  # seconds: still running at the kill
    streams, started = {}, threading.Event()

    def stream(i):
        with httpx.stream("POST", f"{cli_server.url}/v1/completions", json=long_stream, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    streams[i] = r.headers["x-specdeploy-replica"]
                    started.set()
            return lines

    def plain(_):
        r = httpx.post(f"{cli_server.url}/v1/completions", json=body, timeout=120)
        return r.status_code, r.json(), r.headers.get("x-specdeploy-replica")

    with ThreadPoolExecutor(24) as pool:
        stream_futures = [pool.submit(stream, i) for i in range(2)]
        assert started.wait(60), "a stream started"
        victim = next(iter(streams.values()))  # the replica writing the first stream
        # More than one replica takes (pool 1 + queue 8): both have requests waiting when the victim dies.
        plain_futures = [pool.submit(plain, i) for i in range(20)]
        time.sleep(0.3)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::long#SpecDeploy#{victim}", namespace="serve"), no_restart=True)
        results = [f.result(timeout=180) for f in plain_futures]
        stream_lines = [f.result(timeout=180) for f in stream_futures]

    texts = set()
    for status, answer, replica in results:
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == body["max_tokens"]
        texts.add(answer["choices"][0]["text"])
    assert len(texts) == 1, "greedy: every answer the same, resent or not"
    for i, lines in enumerate(stream_lines):
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if streams[i] == victim:
            assert last["error"]["code"] == "replica_failed" and last["error"]["type"] == "internal_error"
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert all(replica != victim for *_, replica in results), "answered by the live replica"
    # Which path saved them depends on timing: a request the victim had accepted is resent by ray_failover
    # ("resending"); one Ray's router was still placing is re-routed by the router itself.
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    text = "".join(f.read_text(errors="replace") for f in [*logs.glob("worker-*.err"), *logs.glob("serve/proxy_*")])
    print(f"replica kill: {text.count('resending')} resent by ray_failover, "
          f"{text.count('will not be considered for future requests')} router notices")
    # Ray Serve replaces the dead replica.
    wait_for(lambda: running_replicas("long") == 2, 120, "a new replica for the killed one")


def test_sigint_lets_running_requests_finish(cli_server):
    body = {"model": "long", "prompt": PROMPTS[2], "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{cli_server.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        cli_server.proc.send_signal(signal.SIGINT)  # serve.delete: the replicas drain before they stop
        rest = [line for line in lines if line.startswith("data: ")]
    assert first and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert cli_server.proc.wait(90) == 0
    assert "stopping" in cli_server.log.read_text()


# -- /auto: autoscaling ---------------------------------------------------------------------------

def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(cluster, micro_export):
    from specdeploy.serve.ray_deployment import specdeploy_app

    options = scaling(Namespace(replicas=None, autoscale="1,2", autoscale_delays="1,3"))  # as the CLI builds it
    serve.run(specdeploy_app(micro_export, num_cpus=0.5, app_options={"model_name": "micro"}, **options),
              name="auto", route_prefix="/auto")
    try:
        assert running_replicas("auto") == 1
        stop = threading.Event()
        body = {"model": "micro", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}

        def load():
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    assert c.post(f"{cluster.url}/auto/v1/completions", json=body).status_code == 200

        with ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(load) for _ in range(6)]
            try:
                start = time.monotonic()
                wait_for(lambda: running_replicas("auto") == 2, 60, "a second replica under load")
                up_s = time.monotonic() - start
            finally:
                stop.set()
            for f in clients:
                f.result(timeout=60)
        start = time.monotonic()
        wait_for(lambda: running_replicas("auto") == 1, 60, "back to one replica without load")
        print(f"autoscaling: +1 replica {up_s:.1f} s into the load, -1 replica {time.monotonic() - start:.1f} s after")
    finally:
        serve.delete("auto")
