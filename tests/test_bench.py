"""`specdeploy bench` on the micro family with tiny settings: schema, table, plot, and token equality;
the roofline's byte counts; the llama.cpp peer (when its venv exists)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from conftest import BUILD, hf_greedy, run_cli

from specdeploy.runtime.loaded_export import LoadedExport

# The micro family repeats newlines after most prompts; this one makes it write varied
# code, so "the peer's tokens equal ours" compares something.
PROMPT = "def f(x):\n    return"
NEW = 12
ROW_KEYS = {"system": str, "method": str, "prompt_set": str, "tokens_per_s": float, "ms_per_token": float,
            "new_tokens": int, "peak_rss_mb": float, "prompts": int}


@pytest.fixture(scope="module")
def bench(micro_export, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    prompts = tmp / "code.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    proc = run_cli("bench", micro_export, "--methods", "ar,prompt-lookup,medusa", "--peers", "hf",
                   "--prompts", prompts, "--num-prompts", "1", "--max-new-tokens", NEW, "--repeats", "1",
                   "--json", tmp / "bench.json", "--plot", tmp / "bench.png", "--markdown", tmp / "BENCH.md",
                   "--bandwidth-mib", 128, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return SimpleNamespace(proc=proc, tmp=tmp, result=json.loads((tmp / "bench.json").read_text()))


def test_json_schema(bench):
    result = bench.result
    rows = {(r["system"], r["method"]): r for r in result["results"]}
    assert set(rows) == {("specdeploy", "ar"), ("specdeploy", "prompt-lookup"), ("hf", "ar"), ("hf", "prompt-lookup")}
    for r in rows.values():
        for key, kind in ROW_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["prompt_set"] == "code"
        assert r["new_tokens"] == NEW  # EOS ignored: every system produces exactly max_new_tokens
        assert r["tokens_per_s"] > 0 and r["ms_per_token"] == pytest.approx(1000 / r["tokens_per_s"])
        assert r["acceptance_length"] >= 1.0
    assert rows[("specdeploy", "ar")]["acceptance_length"] == 1.0
    assert rows[("specdeploy", "ar")]["info"]["torch_imported"] is False  # the runtime's process stays torch-free
    # medusa: not in this export (or not a runtime method yet) -> reported, not a crash
    assert any(s["method"] == "medusa" and s["system"] == "specdeploy" for s in result["skipped"])
    assert result["meta"]["threads"] == 2 and result["meta"]["ignore_eos"] is True
    limit = result["limit"]
    assert limit["bandwidth_gbs"] > 0 and limit["weight_bytes"] > 0
    assert limit["bandwidth"]["measurements"] == 2  # before the workers start and after they stop
    assert limit["ceiling_tokens_per_s"] == pytest.approx(limit["bandwidth_gbs"] * 1e9 / limit["weight_bytes"])
    assert 0 < limit["ar_fraction"]["specdeploy"]["code"]
    assert set(limit["systems"]) == {"specdeploy", "hf"}  # only systems that ran
    for r in rows.values():  # every row's share of the bound: its passes/s x bytes per pass / bandwidth
        read_per_s = r["passes_per_s"] * r["bytes_per_pass"]
        assert r["roofline_share"] == pytest.approx(read_per_s / (limit["bandwidth_gbs"] * 1e9))
        assert r["roofline_share"] > 0


def test_peer_greedy_tokens_equal_ours(bench, micro_family):
    per = {(p["system"], p["method"]): p["token_ids"] for p in bench.result["per_prompt"]}
    ours = per[("specdeploy", "ar")]
    assert len(set(ours)) > 3  # a varied continuation, not one token repeated
    assert per[("hf", "ar")] == ours
    assert per[("hf", "prompt-lookup")] == ours
    assert per[("specdeploy", "prompt-lookup")] == ours
    # and an HF run outside the bench agrees, so the bench cannot be comparing a thing with itself
    from specdeploy.runtime.tokenizer import TextTokenizer

    ids = TextTokenizer(micro_family / "tokenizer").encode(PROMPT)
    assert hf_greedy(micro_family / "target", ids, NEW) == ours
    assert all(r["mismatches"] == 0 for r in bench.result["results"])


def test_table_plot_and_markdown(bench):
    out = bench.proc.stdout
    assert "| system | method | tokens/s |" in out
    for line in ("| specdeploy | ar |", "| hf | ar |", "| specdeploy | prompt-lookup |", "| hf | prompt-lookup |"):
        assert line in out
    png = (bench.tmp / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    md = (bench.tmp / "BENCH.md").read_text()
    assert "## Machine" in md and "bench.png" in md and "tokens/s" in md and "## The machine's limit" in md
    assert "share of bound" in md and "The bound holds" in md
    # the CPU's kernel-deciding vector extensions, read from /proc/cpuinfo (x86-64: avx2 at least; arm64: asimd)
    isa = bench.result["machine"]["isa"]
    assert isa and f"vector extensions: {', '.join(isa)}" in md
    assert "[" in bench.proc.stderr and "tok/s" in bench.proc.stderr  # progress while it runs
    # which draft model each system drafts with: the micro export's own, which peers load too
    assert bench.result["meta"]["draft"] == {"self": False, "bits": None}
    assert "- draft model: the export's (`export --draft DIR`)" in md


def test_the_report_names_each_systems_self_draft():
    from specdeploy.bench.report import draft_lines

    assert draft_lines(None) == []
    line, = draft_lines({"self": True, "bits": 8})
    assert "ours at int8 weights" in line and "int4 build" in line and "Q4_1 GGUF" in line


def test_a_rerun_replaces_its_own_outputs_and_refuses_anything_else(micro_export, tmp_path):
    """`make bench` reruns with the same --json/--plot/--markdown: what a bench wrote is replaced; a file
    that is not a bench's output (a PNG without bench's mark, the prompts) is refused before anything
    runs, and left as it was."""
    from specdeploy.bench.report import PNG_MARK, _png_text

    prompts = tmp_path / "code.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = {"--json": tmp_path / "bench.json", "--plot": tmp_path / "bench.png", "--markdown": tmp_path / "BENCH.md"}

    def bench(**paths):
        flags = [x for flag, path in {**out, **paths}.items() for x in (flag, path)]
        return run_cli("bench", micro_export, "--methods", "ar", "--peers", "none", "--prompts", prompts,
                       "--num-prompts", 1, "--warm-prompts", 1, "--max-new-tokens", 4, "--repeats", 1,
                       "--no-bandwidth", *flags, timeout=180)

    first = bench()
    assert first.returncode == 0, first.stderr[-2000:]
    assert _png_text(out["--plot"])[PNG_MARK[0]] == PNG_MARK[1]
    for path in out.values():
        os.utime(path, (0, 0))
    again = bench()
    assert again.returncode == 0, again.stderr[-2000:]
    assert all(path.stat().st_mtime > 0 for path in out.values())  # each rewritten
    assert _png_text(out["--plot"])[PNG_MARK[0]] == PNG_MARK[1]
    assert json.loads(out["--json"].read_text())["meta"]["command"].endswith(f"--markdown {out['--markdown']}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    theirs = tmp_path / "theirs.png"
    plt.figure().savefig(theirs)  # a Matplotlib PNG without bench's mark
    plt.close("all")
    for flag, path in (("--plot", theirs), ("--json", prompts)):
        before = path.read_bytes()
        refused = bench(**{flag: path})
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {flag} {path}")
        assert "starting workers" not in refused.stderr and path.read_bytes() == before


def test_mismatch_counting_is_real():
    """A peer whose tokens differ from the reference at index 2 is counted, with where it diverged."""
    from specdeploy.bench import run

    workers = [SimpleNamespace(label=f"{s}/ar", system=s, method="ar", peak_rss_mb=1.0, info={})
               for s in ("specdeploy", "hf")]
    reply = lambda toks: {"token_ids": toks, "seconds": 0.1, "target_calls": len(toks)}  # noqa: E731
    samples = {("code", "specdeploy/ar", 0): [reply([5, 6, 7, 8])], ("code", "hf/ar", 0): [reply([5, 6, 9, 8])],
               ("code", "specdeploy/ar", 1): [reply([1, 2])], ("code", "hf/ar", 1): [reply([1, 2])]}
    export = SimpleNamespace(manifest=SimpleNamespace(models={}, raw={}, dtype="float32"), methods={})
    opts = run.BenchOptions(export="x", prompt_files={"code": "code.jsonl"})
    res = run._aggregate(workers, {"code": [[1], [2]]}, samples, [], opts, export, {}, None)
    rows = {r["system"]: r for r in res["results"]}
    assert rows["specdeploy"]["mismatches"] == 0
    assert rows["hf"]["mismatches"] == 1
    assert rows["hf"]["mismatch_detail"] == [{"prompt": 0, "first_diff": 2, "tokens": 4}]


def test_precision_groups_compare_each_row_with_its_own_precisions_ar():
    """Quantized rows: tokens against our ar of the same precision (not float32's), speedup over the
    best AR of that precision, and the quantized AR over our float AR."""
    from specdeploy.bench import run

    labels = ("specdeploy/ar", "specdeploy-int4/ar", "specdeploy-int4/suffix", "llamacpp-q4_1/ar", "ortgenai-int4/ar")
    workers = [SimpleNamespace(label=lb, system=lb.split("/")[0], method=lb.split("/")[1], peak_rss_mb=1.0, info={})
               for lb in labels]
    reply = lambda toks, s: {"token_ids": toks, "seconds": s, "target_calls": len(toks)}  # noqa: E731
    samples = {("code", "specdeploy/ar", 0): [reply([5, 6, 7, 8], 0.4)],
               ("code", "specdeploy-int4/ar", 0): [reply([5, 6, 9, 9], 0.2)],  # int4 differs from float32 ...
               ("code", "specdeploy-int4/suffix", 0): [reply([5, 6, 9, 9], 0.1)],  # ... suffix equals int4's ar
               ("code", "llamacpp-q4_1/ar", 0): [reply([5, 6, 9, 1], 0.25)],
               ("code", "ortgenai-int4/ar", 0): [reply([5, 6, 9, 9], 0.32)]}
    export = SimpleNamespace(manifest=SimpleNamespace(models={}, raw={}, dtype="float32"), methods={})
    opts = run.BenchOptions(export="x", prompt_files={"code": "code.jsonl"})
    res = run._aggregate(workers, {"code": [[1]]}, samples, [], opts, export, {}, None)
    rows = {(r["system"], r["method"]): r for r in res["results"]}
    assert res["meta"]["references"] == {"float32": "specdeploy/ar", "int4": "specdeploy-int4/ar"}
    assert rows[("specdeploy-int4", "ar")]["precision"] == "int4" and rows[("specdeploy-int4", "ar")]["mismatches"] == 0
    assert rows[("specdeploy-int4", "suffix")]["mismatches"] == 0
    assert rows[("llamacpp-q4_1", "ar")]["mismatch_detail"] == [{"prompt": 0, "first_diff": 3, "tokens": 4}]
    assert rows[("specdeploy-int4", "suffix")]["speedup"] == pytest.approx(2.0)  # over int4's best AR (ours)
    assert rows[("specdeploy-int4", "ar")]["ar_vs_float"] == pytest.approx(2.0)
    assert rows[("specdeploy", "ar")]["speedup"] == 1.0 and "ar_vs_float" not in rows[("specdeploy", "ar")]
    from specdeploy.bench.report import markdown_table, targets

    table = markdown_table(res)
    assert "| int4 | specdeploy-int4 | suffix |" in table and "1/1 (other quantization)" in table
    assert ("code: our int4 ar >= 3x our float ar", "2.00x", False) in targets(res)
    assert rows[("ortgenai-int4", "ar")]["precision"] == "int4"  # genai's int4 build sits in the int4 group
    assert ("code: our int4 ar >= onnxruntime-genai int4 ar", "20.0 vs 12.5 tok/s", True) in targets(res)


def test_repeated_set_gets_more_prompts_at_the_same_tokens_per_pass():
    from specdeploy.bench import run

    opts = run.BenchOptions(export="x", num_prompts=3, max_new_tokens=96, warm_prompts=6)
    assert run.set_shape("repeated", opts) == (6, 48) and run.set_shape("code", opts) == (3, 96)
    assert run.set_shape("repeated", run.BenchOptions(export="x", num_prompts=8, warm_prompts=6)) == (8, 128)


def test_shipped_prompt_sets():
    from specdeploy.bench.prompts import load_items, shipped_sets

    chat, raw = shipped_sets(chat=True), shipped_sets(chat=False)
    assert set(chat) == {"chat", "code", "grounded", "repeated"} and set(raw) == {"code", "grounded", "repeated"}
    for path in {*chat.values(), *raw.values()}:
        items = load_items(path)
        assert len(items) >= 8 and len({json.dumps(i) for i in items}) == len(items)
    assert all("chat" in i for i in load_items(chat["chat"]) + load_items(chat["grounded"]))
    assert all(set(i) == {"prompt"} and i["prompt"].startswith("# Original:") for i in load_items(raw["grounded"]))
    assert chat["code"] == raw["code"] and all("prompt" in i for i in load_items(chat["code"]))
    # the repeated-task sets: one kind of request, other data each time
    assert len({i["system"] for i in load_items(chat["repeated"])}) == 1
    assert len({i["chat"].split("\n\n")[0] for i in load_items(chat["repeated"])}) == 1
    assert all(set(i) == {"prompt"} and i["prompt"].startswith("class ") for i in load_items(raw["repeated"]))


def _suffix_worker(export, tmp_path, method="suffix"):
    from specdeploy.bench import run
    from specdeploy.bench.workers import Worker
    from specdeploy.runtime.loaded_export import LoadedExport

    opts = run.BenchOptions(export=export, threads=1)
    loaded = LoadedExport(export)
    w = Worker("specdeploy", method, run._setup_message("specdeploy", method, opts, loaded, {}),
               tmp_path / "worker.log", opts.peers_dir)
    w.launch()
    w.ready(120)
    return w, loaded


def test_a_fresh_suffix_cache_per_run_unless_the_set_keeps_it_warm(micro_export, tmp_path):
    """The bench's suffix worker: a run asking for a fresh cache drafts as the first run did (nothing
    learnt from it); one that keeps the cache proposes the earlier run's whole answer."""
    from specdeploy.bench import run

    w, export = _suffix_worker(micro_export, tmp_path)
    try:
        ids = export.tokenizer.encode(PROMPT)
        opts = run.BenchOptions(export=micro_export, max_new_tokens=32)
        calls = [w.call(run._request(ids, opts, opts.max_new_tokens, fresh_cache=fresh), 120)["target_calls"]
                 for fresh in (True, True, False)]
    finally:
        w.close()
    assert calls[0] == calls[1]  # the second run did not see the first one's output
    assert calls[2] < calls[1] / 2  # the warm cache drafts the repeated answer in long runs


def test_our_methods_share_a_process_and_each_keeps_its_own_warm_cache(micro_export, tmp_path):
    """Our methods of one export run in one worker process (the weights held once), yet on a warm set each
    method's suffix cache holds only its own earlier outputs, though suffix and lookahead+suffix share one
    cache per export: suffix drafts exactly as in a process of its own."""
    from specdeploy.bench import run
    from specdeploy.bench.workers import MethodView, Worker

    loaded = LoadedExport(micro_export)
    opts = run.BenchOptions(export=micro_export, threads=1, max_new_tokens=32)
    setup = run._setup_message("specdeploy", "suffix", opts, loaded, {})
    process = Worker("specdeploy", "suffix", {**setup, "methods": ["suffix", "lookahead+suffix"]},
                     tmp_path / "shared.log", opts.peers_dir)
    process.launch()
    process.ready(120)
    rows: list = []
    suffix, fused = MethodView(process, "suffix", rows), MethodView(process, "lookahead+suffix", rows)
    p, q = (loaded.tokenizer.encode(text) for text in (PROMPT, "def multiply(a, b):\n    return"))

    def calls(w, ids, fresh):
        return w.call(run._request(ids, opts, opts.max_new_tokens, fresh_cache=fresh), 120)["target_calls"]

    try:
        assert fused.info["methods_in_process"] == ["lookahead+suffix", "suffix"]
        assert fused.info["method_params"] != suffix.info["method_params"]
        calls(suffix, p, True)
        calls(fused, q, True)  # q's answer goes into the cache the two methods share
        shared = calls(suffix, q, False)  # suffix's warm cache: p's answer only
        fused_warm = calls(fused, q, False)  # lookahead+suffix's: its own answer to q
    finally:
        suffix.close()
        fused.close()
    assert process.proc.poll() is not None  # the last row stopped the process
    alone, _ = _suffix_worker(micro_export, tmp_path)
    try:
        calls(alone, p, True)
        assert calls(alone, q, False) == shared
        calls(alone, q, True)
        polluted = calls(alone, q, False)  # what suffix would have drafted with q's answer in its cache
        assert polluted < shared and fused_warm < shared
    finally:
        alone.close()


def test_warm_cache_sets_start_each_pass_empty_and_other_sets_every_run():
    from specdeploy.bench import run

    class Recorder:  # records what the bench asks a worker; the worker's side is tested above
        label, asked = "specdeploy/suffix", []

        def call(self, msg, timeout):
            self.asked.append(msg["fresh_cache"])
            return {"token_ids": [1], "seconds": 0.1, "target_calls": 1}

    w = Recorder()
    opts = run.BenchOptions(export="x", repeats=2)
    run._interleave([w], {"code": [[1], [2]], "repeated": [[1], [2], [3]]}, opts, {}, {})
    assert w.asked == [True, True, True, False, False] * 2


def test_tokens_per_s_and_acceptance_come_from_the_same_median_run():
    from specdeploy.bench import run

    workers = [SimpleNamespace(label="specdeploy/suffix", system="specdeploy", method="suffix", peak_rss_mb=1.0,
                               info={})]
    toks = list(range(12))
    runs = [{"token_ids": toks, "seconds": s, "target_calls": c} for s, c in ((0.9, 12), (0.2, 2), (0.5, 6))]
    export = SimpleNamespace(manifest=SimpleNamespace(models={}, raw={}, dtype="float32"), methods={})
    opts = run.BenchOptions(export="x", prompt_files={"code": "code.jsonl"})
    res = run._aggregate(workers, {"code": [[1]]}, {("code", "specdeploy/suffix", 0): runs}, [], opts, export, {},
                         None)
    row = res["results"][0]
    assert row["seconds"] == 0.5 and row["target_calls"] == 6  # the median run's time and its calls
    assert row["tokens_per_s"] == pytest.approx(12 / 0.5) and row["acceptance_length"] == pytest.approx(12 / 6)


SMOLLM2 = BUILD / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                    reason="build/models/smollm2-135m-instruct absent (make model)")
def test_chat_prompts_go_through_the_chat_template():
    from specdeploy.bench.prompts import encode_items
    from specdeploy.runtime.chat_template import ChatTemplate, chat_messages, encode_rendered
    from specdeploy.runtime.tokenizer import TextTokenizer

    export = SimpleNamespace(tokenizer=TextTokenizer(SMOLLM2))
    items = [{"chat": "Why is the sky blue?", "system": None}, {"prompt": "def f(x):"}]
    ids = encode_items(items, export)
    rendered = ChatTemplate.from_tokenizer_dir(SMOLLM2).render(chat_messages("Why is the sky blue?"))
    assert rendered.startswith("<|im_start|>system") and rendered.endswith("<|im_start|>assistant\n")
    assert ids[0] == encode_rendered(export.tokenizer, rendered)
    assert ids[1] == export.tokenizer.encode("def f(x):")


def test_chat_prompts_without_a_template_are_refused(micro_family):
    from specdeploy.bench.prompts import encode_items
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.tokenizer import TextTokenizer

    export = SimpleNamespace(tokenizer=TextTokenizer(micro_family / "tokenizer"))
    with pytest.raises(SpecDeployError, match="chat template"):
        encode_items([{"chat": "hello", "system": None}], export)


# ----------------------------------------------------------------- the roofline


def _onnx_lm(path, vocab: int, hidden: int, tied: bool):
    """embed -> one hidden MatMul -> LM head; tied: the head is the embedding, transposed."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    embed = numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "embed")
    w = numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32), "w")
    inits, nodes = [embed, w], [helper.make_node("Gather", ["embed", "ids"], ["x"]),
                                helper.make_node("MatMul", ["x", "w"], ["h"])]
    if tied:
        nodes += [helper.make_node("Transpose", ["embed"], ["head"], perm=[1, 0])]
    else:
        inits.append(numpy_helper.from_array(rng.standard_normal((hidden, vocab)).astype(np.float32), "head"))
    nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"]))
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, vocab])], inits)
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_roofline_counts_a_tied_embedding_once(tmp_path):
    """Bytes per pass: every weight once; the gather one row per token; a tied embedding whole, once."""
    import numpy as np
    from safetensors.numpy import save_file

    from specdeploy.bench import roofline

    vocab, hidden = 1000, 64
    table, layer, row = vocab * hidden * 4, hidden * hidden * 4, hidden * 4
    tied = roofline.onnx_weight_bytes(_onnx_lm(tmp_path / "tied.onnx", vocab, hidden, tied=True))
    untied = roofline.onnx_weight_bytes(_onnx_lm(tmp_path / "untied.onnx", vocab, hidden, tied=False))
    assert tied["bytes_per_pass"] == table + layer  # the embedding read whole once, as the head; no extra row
    assert untied["bytes_per_pass"] == row + layer + table  # one gathered row + the separate head whole
    assert roofline.onnx_weight_bytes(tmp_path / "untied.onnx", tokens=5)["bytes_per_pass"] == 5 * row + layer + table

    for name, tie in (("tied", True), ("untied", False)):  # the same count from a Hugging Face dir
        d = tmp_path / f"hf-{name}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tie}))
        tensors = {"model.embed_tokens.weight": np.zeros((vocab, hidden), np.float32),
                   "model.layers.0.w": np.zeros((hidden, hidden), np.float32)}
        if not tie:
            tensors["lm_head.weight"] = np.zeros((vocab, hidden), np.float32)
        save_file(tensors, str(d / "model.safetensors"))
    assert roofline.hf_weight_bytes(tmp_path / "hf-tied")["bytes_per_pass"] == table + layer
    assert roofline.hf_weight_bytes(tmp_path / "hf-untied")["bytes_per_pass"] == row + layer + table


def _quantized_lm(path, vocab: int, hidden: int, tied: bool, block: int = 32):
    """A 4-bit LM as export/quantize.py writes one: GatherBlockQuantized embedding (through an Identity
    when tied: the LM head's blob, scales and zero points), MatMulNBits layer and head."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def q4(name, n):  # MatMulNBits' B [N, K/block, block/2], scales [N, K/block], zero points [N, K/block/2]
        k = hidden // block
        return [numpy_helper.from_array(np.zeros((n, k, block // 2), np.uint8), f"{name}_Q4"),
                numpy_helper.from_array(np.ones((n, k), np.float32), f"{name}_scales"),
                numpy_helper.from_array(np.zeros((n, (k + 1) // 2), np.uint8), f"{name}_zero_points")]

    def matmul(x, name, n, out):
        return helper.make_node("MatMulNBits", [x, f"{name}_Q4", f"{name}_scales", f"{name}_zero_points"], [out],
                                domain="com.microsoft", K=hidden, N=n, bits=4, block_size=block)

    inits = q4("layer", hidden) + q4("head", vocab)
    nodes = [matmul("x", "layer", hidden, "h"), matmul("h", "head", vocab, "logits")]
    table = "embed"
    if tied:
        nodes.append(helper.make_node("Identity", ["head_Q4"], ["embed_Q4"]))
        table = "head"
    else:
        inits += q4("embed", vocab)
    nodes.append(helper.make_node("GatherBlockQuantized", ["embed_Q4", "ids", f"{table}_scales",
                                                           f"{table}_zero_points"], ["x"], domain="com.microsoft",
                                  bits=4, block_size=block, gather_axis=0, quantize_axis=1))
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, vocab])], inits)
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_roofline_counts_quantized_weights_blob_scales_and_zero_points(tmp_path):
    """MatMulNBits: blob + scales + zero points, whole; a quantized embedding (GatherBlockQuantized): one
    row of each per token; tied (the head's tensors through an Identity): read whole once, as the head."""
    from specdeploy.bench import roofline

    vocab, hidden = 1000, 64
    per_row = hidden // 2 + (hidden // 32) * 4 + 1  # 4-bit blob + float32 scales + packed zero points
    layer, head = hidden * per_row, vocab * per_row
    tied = roofline.onnx_weight_bytes(_quantized_lm(tmp_path / "tied.onnx", vocab, hidden, tied=True))
    untied = roofline.onnx_weight_bytes(_quantized_lm(tmp_path / "untied.onnx", vocab, hidden, tied=False), tokens=2)
    assert tied["bytes_per_pass"] == layer + head and tied["gathered_bytes"] == 0
    assert untied["bytes_per_pass"] == layer + head + 2 * per_row and untied["gathered_bytes"] == 2 * per_row


def test_roofline_counts_gguf_tensors(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    from specdeploy.bench.llamacpp import gguf_weight_bytes

    vocab, hidden = 1000, 64
    for name, tie in (("tied", True), ("untied", False)):
        w = GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), np.float32))
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((hidden, hidden), np.float32))
        if not tie:
            w.add_tensor("output.weight", np.zeros((vocab, hidden), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    table, layer, row = vocab * hidden * 4, hidden * hidden * 4, hidden * 4
    assert gguf_weight_bytes(tmp_path / "tied.gguf")["bytes_per_token"] == table + layer
    assert gguf_weight_bytes(tmp_path / "untied.gguf")["bytes_per_token"] == row + layer + table


def test_roofline_shares_and_the_bound_check():
    """share = passes/s x bytes per pass / bandwidth; a row above 100% says the bound does not hold."""
    from specdeploy.bench import run

    target = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)
    export = SimpleNamespace(manifest=SimpleNamespace(models={"target": target}, raw={}, dtype="float32"))
    opts = run.BenchOptions(export="x", max_new_tokens=10)
    bandwidth = {"read_gbs": 10.0}
    rows = [{"prompt_set": "code", "system": "specdeploy", "method": "ar", "target_calls": 100, "seconds": 1.0},
            {"prompt_set": "code", "system": "hf", "method": "prompt-lookup", "target_calls": 30, "seconds": 1.0}]
    per_system = {"specdeploy": {"bytes_per_pass": 50e6, "kv_itemsize": 4},
                  "hf": {"bytes_per_pass": 50e6, "kv_itemsize": 4}}
    limit = run._limit(rows, {"code": [[1] * 20]}, opts, export, bandwidth, per_system)
    kv = 2 * 2 * 1 * 4 * (20 + 5) * 4  # K and V, 2 layers, mean position 20 + 10/2, float32
    assert rows[0]["kv_bytes_per_pass"] == kv
    assert rows[0]["roofline_share"] == pytest.approx(100 * (50e6 + kv) / 10e9)
    assert rows[1]["roofline_share"] == pytest.approx(30 * (50e6 + kv) / 10e9)
    assert limit["holds"] and limit["max_share_row"] == "specdeploy/ar (code)"
    rows[1]["target_calls"] = 300  # 300 passes/s x 50 MB = 15 GB/s > 10 GB/s: impossible
    limit = run._limit(rows, {"code": [[1] * 20]}, opts, export, bandwidth, per_system)
    assert not limit["holds"] and limit["max_share"] > 1


def test_bandwidth_is_measured_on_cpu_time_and_summarized():
    from specdeploy.bench import machine

    a = {"array_mib": 64, "trials": 2, "wall_gbs": {"sum/1t": 5.0}, "cpu_gbs": {"sum/1t": 20.0, "dot/2t": 30.0}}
    b = {"array_mib": 64, "trials": 2, "wall_gbs": {"sum/1t": 7.0}, "cpu_gbs": {"sum/1t": 25.0, "dot/2t": 28.0}}
    s = machine.summarize_bandwidth([a, b])
    assert s["read_gbs"] == 30.0 and s["read_kernel"] == "dot/2t" and s["wall_gbs"]["sum/1t"] == 7.0
    live = machine._bandwidth_here(64, (1,), 1)  # the measurement itself, small
    assert set(live["cpu_gbs"]) == {"sum/1t", "dot/1t", "gemv/1t"}
    assert all(live["cpu_gbs"][k] >= live["wall_gbs"][k] * 0.5 for k in live["cpu_gbs"])


def test_rope_rows_turn_hf_rotate_half_into_llamacpp_pairs():
    """A q/k projection permuted by _rope_rows, roped as llama.cpp does (adjacent pairs), equals
    HF's rotate-half rope of the unpermuted projection, permuted the same way."""
    import numpy as np

    from specdeploy.bench.llamacpp import _rope_rows

    heads, d, hidden, pos = 3, 8, 12, 5
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((heads * d, hidden)), rng.standard_normal(hidden)
    theta = pos * 10000.0 ** (-np.arange(d // 2) * 2 / d)
    q = (w @ x).reshape(heads, d)
    cos, sin = np.cos(np.concatenate([theta, theta])), np.sin(np.concatenate([theta, theta]))
    hf = q * cos + np.concatenate([-q[:, d // 2:], q[:, : d // 2]], axis=1) * sin
    p = (_rope_rows(w, heads) @ x).reshape(heads, d // 2, 2)
    a, b = p[..., 0], p[..., 1]
    ours = np.stack([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)], -1)
    assert np.allclose(ours.reshape(heads, d), _rope_rows(hf.reshape(heads * d, 1), heads).reshape(heads, d))


# ----------------------------------------------------------------- the llama.cpp peer


def _llamacpp_ready() -> str | None:
    from specdeploy.bench import llamacpp
    from specdeploy.bench.peers import DEFAULT_PEERS_DIR

    py = llamacpp.python(DEFAULT_PEERS_DIR)
    if not py.exists() or not llamacpp.version(py):
        return f"no llama-cpp-python venv at {DEFAULT_PEERS_DIR / llamacpp.VENV} (make peers builds it)"
    return None


@pytest.mark.skipif(_llamacpp_ready() is not None, reason=str(_llamacpp_ready()))
def test_llamacpp_worker_greedy_equals_hf(smollm2_4l, tmp_path):
    """The llama.cpp worker on an F32 GGUF written from the 4-layer SmolLM2: greedy tokens equal HF's,
    for ar, prompt lookup and the draft-model hook, and its eval calls are counted."""
    from specdeploy.bench import llamacpp
    from specdeploy.bench.peers import DEFAULT_PEERS_DIR
    from specdeploy.bench.workers import Worker
    from specdeploy.runtime.tokenizer import TextTokenizer

    files = llamacpp.gguf_files(smollm2_4l, None, DEFAULT_PEERS_DIR, "float32", progress=lambda m: None)
    ids = TextTokenizer(smollm2_4l).encode("def fib(n):\n    if n < 2:\n        return n\n"
                                           "    return fib(n - 1) + fib(n - 2)\n\ndef fib2(n):\n")
    new = 16
    want = hf_greedy(smollm2_4l, ids, new)
    for method in ("ar", "prompt-lookup", "draft"):  # draft: the model drafts for itself, so all is accepted
        setup = {"system": "llamacpp", "method": method, "threads": 2, "n_ctx": 256, "gguf": str(files["target"]),
                 "draft_gguf": str(files["target"]), "method_params": {"k": 6, "max_ngram": 3}, "kv_dtype": "float32"}
        w = Worker("llamacpp", method, setup, tmp_path / f"{method}.log", DEFAULT_PEERS_DIR)
        try:
            w.launch()
            w.ready(120)
            reply = w.call({"op": "run", "prompt_ids": ids, "max_new_tokens": new, "temperature": 0.0}, 120)
            again = w.call({"op": "run", "prompt_ids": ids, "max_new_tokens": new, "temperature": 0.0}, 120)
        finally:
            w.close()
        assert reply["token_ids"] == want, method
        assert again["token_ids"] == want and again["target_calls"] == reply["target_calls"]  # no cached prefix
        if method == "ar":
            assert reply["target_calls"] == new  # the prompt's eval, then one per token after the first
        elif method == "draft":
            assert reply["target_calls"] <= 1 + -(-(new - 1) // 7)  # prompt, then k + 1 tokens a pass
        else:
            assert reply["target_calls"] < new  # the function repeats: lookup drafts get accepted
        assert w.info["llama_cpp_python"]


@pytest.fixture(scope="module")
def micro_int4(micro_family, tmp_path_factory):
    """The micro target alone, its fused graphs quantized to int4 (no accuracy check: wiring only)."""
    from specdeploy.export.exporter import export_all
    from specdeploy.export.quantize import QuantPlan

    out = tmp_path_factory.mktemp("quantized") / "int4"
    return export_all(micro_family / "target", out, progress=lambda msg: None,
                      quantize=QuantPlan.from_choices(32, target="int4"))


def test_a_quantized_export_runs_as_its_precisions_system(micro_export, micro_int4, tmp_path):
    """--quantized: the int4 export is planned as specdeploy-int4 (its own methods), its worker runs that
    export (greedy tokens = its own ar in-process, not the float export's); llama.cpp's Q4_1 row is
    planned only beside it; a float export passed as --quantized is refused with the reason."""
    from specdeploy.bench import run
    from specdeploy.bench.workers import Worker
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    float_export = LoadedExport(micro_export)
    opts = run.BenchOptions(export=micro_export, methods=["ar"], peers=["llamacpp-q4_1"], quantized=[micro_int4],
                            quantized_methods=["ar", "medusa"], threads=1)
    quant = run.quantized_exports(opts, float_export)
    assert list(quant) == ["specdeploy-int4"]
    rows, skipped = run.plan(opts, float_export, quant)
    assert ("specdeploy", "ar") in rows and ("specdeploy-int4", "ar") in rows
    assert any(s["system"] == "specdeploy-int4" and s["method"] == "medusa" for s in skipped)  # not exported
    q4_1 = run.plan(run.BenchOptions(export=micro_export, methods=["ar"], peers=["llamacpp-q4_1", "ortgenai-int4"]),
                    float_export)
    assert any(s["system"] == "llamacpp-q4_1" and "--quantized" in s["reason"] for s in q4_1[1])
    assert any(s["system"] == "ortgenai-int4" and "--quantized" in s["reason"] for s in q4_1[1])
    with pytest.raises(SpecDeployError, match="not quantized"):
        run.quantized_exports(run.BenchOptions(export=micro_export, quantized=[micro_export]), float_export)

    ids = float_export.tokenizer.encode(PROMPT)
    w = Worker("specdeploy-int4", "ar", run._setup_message("specdeploy-int4", "ar", opts, float_export, {}, {}, quant),
               tmp_path / "int4.log", opts.peers_dir)
    try:
        w.launch()
        w.ready(120)
        reply = w.call(run._request(ids, opts, NEW), 120)
    finally:
        w.close()
    want = generate(quant["specdeploy-int4"], ids, method="ar", max_new_tokens=NEW, ignore_eos=True).token_ids
    assert reply["token_ids"] == want and w.info["graphs"] == "fused"
    per_system = run.weight_bytes(float_export, None, quant)  # the int4 graph's bytes: well under the float's
    assert per_system["specdeploy-int4"]["bytes_per_pass"] < 0.4 * per_system["specdeploy"]["bytes_per_pass"]


@pytest.mark.skipif(_llamacpp_ready() is not None, reason=str(_llamacpp_ready()))
def test_llamacpp_q8_0_peer_quantizes_the_f32_gguf_and_runs(smollm2_4l, tmp_path):
    """llamacpp-q8_0: llama.cpp's Q8_0 of the F32 GGUF (about 34/32 bytes a weight, not 4), run by the
    llama.cpp worker with the bindings' default KV cache, one eval a token."""
    from specdeploy.bench import llamacpp
    from specdeploy.bench.peers import DEFAULT_PEERS_DIR
    from specdeploy.bench.workers import Worker
    from specdeploy.runtime.tokenizer import TextTokenizer

    files = llamacpp.gguf_files(smollm2_4l, None, DEFAULT_PEERS_DIR, "float32", progress=lambda m: None)
    q8 = llamacpp.quantized_gguf(files["target"], "q8_0", DEFAULT_PEERS_DIR, progress=lambda m: None)
    ratio = llamacpp.gguf_weight_bytes(q8)["bytes_per_token"] / llamacpp.gguf_weight_bytes(files["target"])[
        "bytes_per_token"]
    assert 0.25 < ratio < 0.3
    ids = TextTokenizer(smollm2_4l).encode("def fib(n):\n    if n < 2:\n        return n\n")
    setup = {"system": "llamacpp-q8_0", "method": "ar", "threads": 2, "n_ctx": 256, "method_params": {},
             "gguf": str(q8), "kv_dtype": None}
    w = Worker("llamacpp-q8_0", "ar", setup, tmp_path / "q8.log", DEFAULT_PEERS_DIR)
    try:
        w.launch()
        w.ready(120)
        reply = w.call({"op": "run", "prompt_ids": ids, "max_new_tokens": NEW, "temperature": 0.0}, 120)
    finally:
        w.close()
    assert len(reply["token_ids"]) == NEW and reply["target_calls"] == NEW
    assert w.info["gguf"] == str(q8) and w.info["kv_dtype"] == "float16"


def test_profile_reports_stage_times_and_hot_functions(micro_export):
    proc = run_cli_module("specdeploy.bench.profile", micro_export, "--num-prompts", "1", "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert "ar: 12 tokens" in proc.stdout and "verify" in proc.stdout and "run_with_iobinding" in proc.stdout


def test_profile_reads_chat_prompt_sets_and_says_what_is_missing(micro_export, tmp_path):
    """A chat set goes through the export's template; the micro export has none: one line, exit 2."""
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"chat": "hello"}) + "\n")
    proc = run_cli_module("specdeploy.bench.profile", micro_export, "--prompts", prompts, "--max-new-tokens", "4")
    assert proc.returncode == 2 and "chat template" in proc.stderr and "Traceback" not in proc.stderr


def test_graph_comparison_says_when_the_peer_model_is_missing(micro_export, tmp_path):
    proc = run_cli_module("specdeploy.bench.profile", micro_export, "--graph-vs-ortgenai", "--peers-dir", tmp_path)
    assert proc.returncode != 0 and "make peers" in proc.stderr and "Traceback" not in proc.stderr


def run_cli_module(module, *args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_profile_splits_the_ar_steps_graph_by_op(micro_export):
    proc = run_cli_module("specdeploy.bench.profile", micro_export, "--ops", "--past", "8")
    assert proc.returncode == 0, proc.stderr
    assert "target_fused_t1.onnx (T=1" in proc.stdout and "ms per call" in proc.stdout
    assert "GroupQueryAttention" in proc.stdout and "%" in proc.stdout


def test_workers_run_their_librarys_own_openmp_wait_policy(monkeypatch, tmp_path):
    """`make` exports OMP_WAIT_POLICY=PASSIVE (for training); inherited, it slowed llama.cpp's decode 2.4x.
    A worker drops it, unless the bench itself runs every system passive (--ort-spinning off)."""
    from specdeploy.bench.workers import Worker

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    for system in ("specdeploy", "hf", "llamacpp", "ortgenai"):
        env = Worker(system, "ar", {"threads": 2}, tmp_path / "w.log", tmp_path).env
        assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env, system
        assert env["OMP_NUM_THREADS"] == "2"
    env = Worker("hf", "ar", {"threads": 2, "ort_spinning": "off"}, tmp_path / "w.log", tmp_path).env
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_row_exact_probe_reports_each_scheme_and_refuses_bad_shapes():
    """bench/row_exact.py: a real MatMulNBits per scheme. 8-bit at block 32 is row-exact on every CPU
    measured (AVX512-VNNI and AVX2): the premise of an int8 target decoding lone rows unpadded."""
    import subprocess
    import sys

    from specdeploy.bench.row_exact import probe

    r = probe(64, 96, bits=8, block=32, symmetric=False)
    assert r["lone_differs"] == 0 and r["ms_1"] > 0 and r["ms_2"] > 0
    ok = subprocess.run([sys.executable, "-m", "specdeploy.bench.row_exact", "--shapes", "64x96", "--bits", "4",
                         "--blocks", "16,32"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [("64x96", "4", "16"), ("64x96", "4", "32")]
    bad = subprocess.run([sys.executable, "-m", "specdeploy.bench.row_exact", "--shapes", "64by96"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--shapes takes" in bad.stderr and "Traceback" not in bad.stderr
