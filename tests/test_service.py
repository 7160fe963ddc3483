"""The embedding API in-process: pool admission, FIFO hand-over, cancellation, stats, the asyncio bridge."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdeploy.runtime import (
    AsyncRequest,
    BusyError,
    Generation,
    GenerationResult,
    LoadedExport,
    SamplingParams,
    Service,
    SpecDeployError,
)


@pytest.fixture(scope="module")
def export_dir(micro_export):
    return micro_export


def test_generate_equals_a_plain_generation(export_dir):
    svc = Service.load(export_dir, pool_size=1)
    export = LoadedExport(export_dir)
    for method, params in [("ar", SamplingParams()), ("draft", SamplingParams(0.8, 0, 1.0, 5))]:
        ids = export.tokenizer.encode("def main():")
        want = Generation(export, ids, method=method, params=params, max_new_tokens=30).result()
        got = svc.generate("def main():", method=method, temperature=params.temperature, seed=params.seed,
                           max_new_tokens=30)
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        for key in ("queue_s", "total_s", "acceptance_length", "target_calls", "tokens_per_s"):
            assert key in got.stats
    assert svc.pool.in_use == 0


def test_the_default_method_is_the_exports_recommended_one(export_dir):
    """Service.load without a method serves `auto`: draft+prompt-lookup on an export with a draft model; a request
    may name "auto" too. Lossless either way: ar's greedy tokens."""
    svc = Service.load(export_dir, pool_size=1)
    assert svc.default_method == "draft+prompt-lookup" and svc.status()["default_method"] == "draft+prompt-lookup"
    ar = svc.generate("def main():", method="ar", max_new_tokens=24, ignore_eos=True)
    for method in (None, "auto"):
        got = svc.generate("def main():", method=method, max_new_tokens=24, ignore_eos=True)
        assert got.stats["method"] == "draft+prompt-lookup" and got.token_ids == ar.token_ids
    assert Service.load(export_dir, pool_size=1, method="suffix").default_method == "suffix"


def test_threads_share_one_service(export_dir):
    svc = Service.load(export_dir, pool_size=2, queue_size=16)
    jobs = [dict(prompt=p, method=m, temperature=t, seed=s, max_new_tokens=30, ignore_eos=True)
            for p, m, t, s in [("import os", "ar", 0.0, None), ("class A:", "draft", 0.9, 1),
                               ("Once upon", "prompt-lookup", 0.0, None), ("The end", "draft", 0.0, None),
                               ("x = 1", "ar", 0.7, 2), ("def f(", "prompt-lookup", 1.0, 3)]]
    sequential = [svc.generate(**job).token_ids for job in jobs]
    with ThreadPoolExecutor(6) as pool:
        parallel = list(pool.map(lambda job: svc.generate(**job).token_ids, jobs * 2))
    assert parallel == sequential * 2
    assert svc.pool.in_use == 0 and svc.pool.waiting == 0


def test_full_queue_and_queue_timeout_are_busy(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=1, queue_timeout=0.3)
    held = svc.stream("hold", max_new_tokens=5)  # started, not iterated: holds the only instance
    outcome = {}

    def waiter():
        t0 = time.monotonic()
        try:
            svc.generate("wait", max_new_tokens=3)
        except BusyError as exc:
            outcome["error"], outcome["waited"] = str(exc), time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    while svc.pool.waiting == 0:
        time.sleep(0.005)
    with pytest.raises(BusyError, match="queue .* is full"):  # the one queue slot is taken
        svc.generate("refused", max_new_tokens=3)
    t.join()
    assert "within" in outcome["error"] and outcome["waited"] >= 0.25
    held.close()
    assert svc.generate("after", max_new_tokens=3).token_ids


def test_hand_over_is_fifo_and_cancel_leaves_the_queue(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=4, queue_timeout=30)
    held = svc.stream("hold", max_new_tokens=5)
    order, reqs = [], []

    def run(req, name):
        if req.start():
            order.append(name)
            req.close()

    threads = []
    for name in "abc":
        reqs.append(svc.request(name, max_new_tokens=2))
        threads.append(threading.Thread(target=run, args=(reqs[-1], name)))
        threads[-1].start()
        while svc.pool.waiting < len(threads):
            time.sleep(0.005)
    reqs[1].cancel()  # "b" gives up its place
    assert svc.pool.waiting == 2
    held.close()
    for t in threads:
        t.join(5)
    assert order == ["a", "c"] and reqs[1].finish_reason == "cancelled"
    assert svc.pool.in_use == 0 and svc.pool.waiting == 0


def test_cancel_mid_stream_returns_the_instance(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=0)
    req = svc.stream("Once upon a time", max_new_tokens=400, ignore_eos=True)
    events = []
    for event in req:
        events.append(event)
        if len(events) == 3:
            threading.Thread(target=req.cancel).start()  # from another thread, as a server would
    assert req.finish_reason == "cancelled" and len(req.token_ids) < 400
    assert req.stats["finish_reason"] == "cancelled" and svc.pool.in_use == 0
    # an abandoned iterator is freed by close() (or `with`)
    with svc.stream("again", max_new_tokens=400, ignore_eos=True) as req2:
        steps = iter(req2)
        next(steps)
        assert svc.pool.in_use == 1
    assert svc.pool.in_use == 0
    assert list(steps) == [] and req2.finish_reason == "cancelled"  # a closed request never steps again
    assert svc.generate("next", max_new_tokens=3).token_ids


def test_cancel_during_prefill_stops_at_the_next_chunk(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=0)
    prompt = [5 + i % 97 for i in range(svc.max_context - 8)]  # several prefill chunks
    req = svc.stream(prompt_ids=prompt, max_new_tokens=4, request_id="prefill-1")
    assert req.id == "prefill-1"
    req.cancel()  # before the first step: the prefill's first chunk runs, then it stops
    assert list(req) == [] and req.finish_reason == "cancelled" and req.error is None
    assert req.stats["prefill_calls"] == 1 and req.stats["target_calls"] == 0
    assert svc.pool.in_use == 0
    assert svc.generate(prompt_ids=prompt, max_new_tokens=2).stats["prefill_calls"] > 1


def test_a_failing_generation_is_an_error_not_a_cancellation(export_dir, tmp_path):
    from serve_util import break_decode_graphs, clone_export

    broken = clone_export(export_dir, tmp_path / "broken")
    break_decode_graphs(broken, 10)  # ONNX Runtime fails from position 10 on
    svc = Service.load(broken, pool_size=1, queue_size=0, method="ar")  # ar calls the broken one-token graphs
    assert len(svc.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=3).token_ids) == 3
    req = svc.request(prompt_ids=[5, 6, 7, 8], max_new_tokens=40)
    with pytest.raises(Exception, match="out of data bounds"):
        req.result()
    assert req.finish_reason == "error" and req.error is not None and req.stats["finish_reason"] == "error"
    assert svc.pool.in_use == 0

    finished = []

    async def main():
        run = AsyncRequest(svc.request(prompt_ids=[5, 6, 7, 8], max_new_tokens=40), on_finish=finished.append)
        assert await run.start()
        with pytest.raises(Exception, match="out of data bounds"):
            await run.result()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.finish_reason for r in finished] == ["error"]


def test_bad_requests_raise_before_queueing(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=0)
    held = svc.stream("hold", max_new_tokens=3)
    for kwargs, match in [(dict(method="nope"), "not served"), (dict(temperature=-1), "temperature"),
                          (dict(top_p=2.0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens"),
                          (dict(stop=5), "stop")]:
        with pytest.raises(SpecDeployError, match=match) as err:
            svc.request("x", **kwargs)
        assert not isinstance(err.value, BusyError)
    with pytest.raises(SpecDeployError, match="exactly one"):
        svc.request("x", prompt_ids=[1, 2])
    with pytest.raises(SpecDeployError, match="max context"):
        svc.request(prompt_ids=[5] * svc.max_context)
    held.close()
    with pytest.raises(SpecDeployError, match="pool size"):
        Service.load(export_dir, pool_size=0)


def test_wrong_types_raise_and_never_strand_an_instance(export_dir):
    """A timeout of the wrong type used to raise inside the pool's wait with the request's ticket still
    queued: the next free instance went to it and never came back (every later request: BusyError)."""
    import numpy as np

    svc = Service.load(export_dir, pool_size=1, queue_size=2, queue_timeout=5)
    held = svc.stream("hold", max_new_tokens=3)  # holds the only instance: a request would queue
    # inf and 1e10 passed a `>= 0` check and raised OverflowError inside Event.wait
    for kwargs, match in [(dict(timeout="x"), "timeout"), (dict(timeout=float("nan")), "timeout"),
                          (dict(timeout=float("inf")), "timeout must be a number of seconds from 0 to"),
                          (dict(timeout=1e10), "timeout must be a number of seconds from 0 to"),
                          (dict(ignore_eos="no"), "ignore_eos"),
                          (dict(prompt=None, prompt_ids=5), "list of token ids"),
                          (dict(prompt=None, prompt_ids={5: 1, 6: 2}), "list of token ids"),  # was its keys
                          (dict(prompt=None, prompt_ids={5, 6}), "list of token ids"),
                          (dict(stop="\ud800"), "stop is not valid UTF-8 text"),
                          (dict(logprobs=True), "logprobs must be an integer from 0 to 20"),
                          (dict(logprobs=21), "logprobs must be an integer from 0 to 20"),
                          (dict(prompt_logprobs="yes"), "prompt_logprobs must be True or False")]:
        with pytest.raises(SpecDeployError, match=match):
            svc.request(**{"prompt": "x", **kwargs})
    with pytest.raises(TypeError):  # the pool itself, interrupted in its wait, withdraws the ticket
        svc.pool.acquire("x")
    with pytest.raises(SpecDeployError, match="queue timeout must be a number of seconds from 0 to"):
        Service.load(export_dir, queue_timeout=float("inf"))
    held.close()
    assert svc.pool.in_use == 0 and svc.pool.waiting == 0
    ids = svc.tokenizer.encode("def f():")
    want = svc.generate(prompt_ids=ids, max_new_tokens=3).token_ids
    assert svc.generate(prompt_ids=np.array(ids), max_new_tokens=3).token_ids == want  # numpy ids are ids
    with svc.stream(prompt_ids=ids, max_new_tokens=3, logprobs=np.int64(2)) as req:  # events carry them in order
        streamed = [lp for e in req for lp in e.logprobs]
        assert [lp.token_id for lp in streamed] == want == [lp.token_id for lp in req.logprobs]
        assert all(len(lp.top) == 2 for lp in streamed)
    assert svc.generate(prompt_ids=ids, max_new_tokens=3).logprobs is None  # not asked for


def test_numpy_numbers_are_taken_as_numbers(export_dir):
    """np.int64(3) as max_new_tokens was refused as 'must be an integer >= 1, got np.int64(3)', np.float32(0.5)
    as 'temperature must be a finite number >= 0'; likewise top_k, seed and Service.load's sizes. Numbers of
    any kind are taken as the Python numbers they equal; bools and floats for counts still are not."""
    import numpy as np

    from specdeploy.runtime.generate import generate

    svc = Service.load(export_dir, pool_size=np.int64(1), queue_size=np.int32(2), queue_timeout=np.float32(5),
                       threads=np.int64(1))
    assert svc.status()["pool_size"] == 1 and svc.status()["queue_size"] == 2
    ids = svc.tokenizer.encode("def f(x):")
    plain = svc.generate(prompt_ids=ids, max_new_tokens=5, temperature=0.5, top_k=5, top_p=0.9, seed=7,
                         ignore_eos=True)
    numpy = svc.generate(prompt_ids=np.array(ids), max_new_tokens=np.int64(5), temperature=np.float32(0.5),
                         top_k=np.int64(5), top_p=np.float64(0.9), seed=np.uint64(7), ignore_eos=True)
    assert numpy.token_ids == plain.token_ids and len(plain.token_ids) == 5
    export = LoadedExport(export_dir)
    greedy = generate(export, ids, max_new_tokens=4, ignore_eos=True).token_ids
    assert generate(export, ids, max_new_tokens=np.int16(4), ignore_eos=True).token_ids == greedy
    assert len(greedy) == 4
    batched = Service.load(export_dir, batch=np.int64(2))
    assert len(batched.generate(prompt_ids=ids, max_new_tokens=np.int64(2), ignore_eos=True).token_ids) == 2
    for kwargs, match in [(dict(max_new_tokens=np.float64(3.0)), "max_new_tokens must be an integer"),
                          (dict(max_new_tokens=np.bool_(True)), "max_new_tokens must be an integer"),
                          (dict(top_k=np.float32(5)), "top_k must be an integer"),
                          (dict(temperature=np.bool_(True)), "temperature")]:
        with pytest.raises(SpecDeployError, match=match):
            svc.request(prompt_ids=ids, **kwargs)
    with pytest.raises(SpecDeployError, match="pool size must be an integer >= 1, got 0"):
        Service.load(export_dir, pool_size=np.int64(0))


@pytest.mark.parametrize("batch", [None, 2])
def test_a_started_request_dropped_unread_frees_its_instance(export_dir, batch):
    """A handler that raised between stream() and reading it dropped its request: collected, it frees
    the instance (or batch row) instead of leaving the service busy for good."""
    import gc

    svc = Service.load(export_dir, pool_size=1) if batch is None else Service.load(export_dir, batch=batch)

    def handler():
        svc.stream("Hello", max_new_tokens=4)
        raise KeyError("the handler failed before reading it")

    with pytest.raises(KeyError):
        handler()
    gc.collect()
    deadline = time.monotonic() + 5  # closed by the reaper thread
    while svc.status()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.status()["in_use"] == 0
    assert svc.generate("Hi", max_new_tokens=2, timeout=5).token_ids


def test_a_request_is_read_once_and_bad_arguments_are_one_error(export_dir):
    """A second iterator would restart the generation over the first's cache; the lower-level
    generate() checks its arguments as Service.request does (a lone stop string is one stop)."""
    svc = Service.load(export_dir, pool_size=1)
    want = svc.generate("Hello", max_new_tokens=6, ignore_eos=True).token_ids
    with svc.stream("Hello", max_new_tokens=6, ignore_eos=True) as req:
        first = iter(req)
        next(first)
        with pytest.raises(SpecDeployError, match="already being read"):
            next(iter(req))
        list(first)
        assert req.result().token_ids == want  # after the read: its result, no second run
    for kwargs, match in [(dict(method=["ar"]), "method must be"), (dict(request_id=5), "request_id"),
                          (dict(stop=5), "stop must be"), (dict(prompt=None, prompt_ids=[1.5]), "integers")]:
        with pytest.raises(SpecDeployError, match=match):
            svc.request(**{"prompt": "x", **kwargs})
    export = LoadedExport(export_dir)
    ids = export.tokenizer.encode("Hello there")
    from specdeploy.runtime.generate import generate

    one = generate(export, ids, max_new_tokens=12, stop="xyz e", ignore_eos=True)
    assert one.text == generate(export, ids, max_new_tokens=12, stop=["xyz e"], ignore_eos=True).text
    for kwargs, match in [(dict(prompt_ids=["1"]), "integers"), (dict(prompt_ids=None), "list of token ids"),
                          (dict(stop=5), "stop must be"), (dict(params={"temperature": 0.5}), "SamplingParams"),
                          (dict(method=["ar"]), "method must be"), (dict(method_overrides=[("k", 1)]), "dict"),
                          (dict(ignore_eos="no"), "ignore_eos")]:
        with pytest.raises(SpecDeployError, match=match):
            generate(export, kwargs.pop("prompt_ids", ids), max_new_tokens=4, **kwargs)
    for bad in (None, 5):
        with pytest.raises(SpecDeployError, match="must be a string"):
            export.tokenizer.encode(bad)
    for bad in ([-1], [2**64], ["a"]):
        with pytest.raises(SpecDeployError):
            export.tokenizer.decode(bad)


def test_close_refuses_a_bad_timeout_before_closing(export_dir):
    """close(timeout=-1) or close(timeout="x") was taken; refused now, with the service still serving."""
    svc = Service.load(export_dir, pool_size=1)
    for timeout in (-1, "x", float("nan"), float("inf"), True):
        with pytest.raises(SpecDeployError, match="timeout must be a number of seconds from 0 to"):
            svc.close(timeout=timeout)
    assert svc.generate("def f():", max_new_tokens=2, ignore_eos=True).finish_reason == "length"
    assert svc.close(timeout=None) and svc.close(timeout=0)


def test_a_batch_whose_cache_cannot_be_resident_is_refused(export_dir):
    """Calibration writes rows of every slot: a batch of a million micro rows (61 GiB of KV cache) grew
    the process until the machine ran out; it is one error, before any cache is allocated."""
    with pytest.raises(SpecDeployError,
                       match=r"a batch of 1000000 rows \(.*\) needs .* GiB of KV cache, .*: serve fewer rows"):
        Service.load(export_dir, batch=10**6)
    with pytest.raises(SpecDeployError,
                       match=r"a pool of 1000000 instances \(.*\) needs .* GiB of KV cache, .*: use a smaller pool"):
        Service.load(export_dir, pool_size=10**6)  # was still building instances after 40 s


def test_async_request_starts_itself_and_start_is_idempotent(export_dir):
    svc = Service.load(export_dir, pool_size=1)
    want = svc.generate("Hello", max_new_tokens=4).token_ids

    async def main():
        unstarted = AsyncRequest(svc.request("Hello", max_new_tokens=4))  # read without start(): it starts
        got = (await asyncio.wait_for(unstarted.result(), 30)).token_ids
        twice = AsyncRequest(svc.request("Hello", max_new_tokens=4))
        assert await twice.start() and await twice.start()
        return got, (await asyncio.wait_for(twice.result(), 30)).token_ids

    assert asyncio.run(main()) == (want, want)

    async def whole():  # what the synchronous Request.result() gives, text and stats included
        return await AsyncRequest(svc.request("Hello", max_new_tokens=4)).result()

    got = asyncio.run(whole())
    assert isinstance(got, GenerationResult) and got.token_ids == want and got.text == svc.generate(
        "Hello", max_new_tokens=4).text and got.finish_reason == "length"


def test_async_bridge(export_dir):
    svc = Service.load(export_dir, pool_size=1, queue_size=0)
    # long enough that the first request still holds the instance when the second asks (the micro
    # model decodes thousands of tokens a second, and 20 could finish before the next line runs)
    want = svc.generate("Hello", max_new_tokens=400, ignore_eos=True)

    async def main():
        run = AsyncRequest(svc.request("Hello", max_new_tokens=400, ignore_eos=True))
        assert await run.start()
        with pytest.raises(BusyError):  # the only instance is taken
            await AsyncRequest(svc.request("other", max_new_tokens=2)).start()
        text = "".join([event.text async for event in run])
        return text, run.request

    text, req = asyncio.run(main())
    assert text == want.text and req.token_ids == want.token_ids
    deadline = time.monotonic() + 5
    while svc.pool.in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.pool.in_use == 0


def test_embedding_example_runs(export_dir):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "embed_service.py"
    proc = subprocess.run([sys.executable, str(example), str(export_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("'status': 200") == 4 and "bad input: {'status': 400" in proc.stdout
