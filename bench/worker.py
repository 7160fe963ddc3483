"""A benchmark worker process: `python -m specdeploy.bench.worker`, driven by bench/run.py.

A peer's (system, method) runs in a process of its own: a crashing peer fails alone, and
torch stays out of our runtime's process (the specdeploy worker never imports it, and says
so). Our methods of one export share one process, as a service runs them, with the weights
held once: a process per method held the same weights 13 times, and with every peer loaded
the bench's processes peaked at 22.5 GiB of the machine's 23.5, evicting each other's pages.
"""

from __future__ import annotations

import sys

from .protocol import serve


class Specdeploy:
    """Our runtime through its public API (Generation.result()), EOS ignored."""

    def __init__(self, setup: dict):
        from ..runtime.backends import thread_pool_mode, use_per_session_threads, use_shared_threads
        from ..runtime.config import to_dict
        from ..runtime.errors import SpecDeployError
        from ..runtime.loaded_export import LoadedExport

        if setup.get("ort_spinning") == "off":  # every session gets its own pool, which sleeps when idle
            use_per_session_threads()
        else:  # as our CLI and server run: one spinning pool for all sessions
            use_shared_threads(setup["threads"])
        self.export = LoadedExport(setup["export"], backend="ort-cpu", threads=setup["threads"])
        self.method = setup["method"]
        self.suffix_caches: dict[str, list] = {}
        self.outputs: dict[str, list[list[int]]] = {}  # per method: its outputs since its last fresh cache
        methods = {}
        for method in setup.get("methods") or [self.method]:
            try:
                config = self.export.method_config(method)  # not exported -> a clear error now, not mid-run
            except SpecDeployError as exc:
                if method == self.method:
                    raise
                methods[method] = {"error": str(exc)}  # that row is reported, the process serves the others
                continue
            self.suffix_caches[method] = suffix_caches(self.export, config)
            self.outputs[method] = []
            methods[method] = {"method_params": to_dict(config)}
            # as a service warms its methods: graphs opened and each small call size run once, so that no
            # timed step pays a size's first run (drafters time their steps by size: step_costs.py)
            self.export.warm_up(method)
        target = self.export.decoder("target")
        self.info = {"thread_pool": thread_pool_mode(), "graphs": "fused" if target.fused else "portable",
                     "methods": methods, **methods[self.method]}

    def prepare(self, req: dict) -> None:
        """Before a run, untimed: the method's cross-request suffix caches hold its own earlier outputs
        of this pass (none where the run is `fresh_cache`), whatever the process's other methods added
        to a cache they share with it (methods whose suffix parts are alike share one per export)."""
        method = req.get("method") or self.method
        if req.get("fresh_cache"):  # no earlier run's output may be proposed to this one
            self.outputs[method] = []
        for cache in self.suffix_caches[method]:
            cache.clear()
            for output in self.outputs[method]:  # as the runs left it: one sequence per output, in order
                cache.extend(cache.begin(), output)

    def run(self, req: dict):
        from ..runtime.generate import Generation
        from ..runtime.sampling import SamplingParams

        method = req.get("method") or self.method
        params = SamplingParams(req["temperature"], seed=req.get("seed"))
        gen = Generation(self.export, req["prompt_ids"], method=method, params=params,
                         max_new_tokens=req["max_new_tokens"], ignore_eos=True)
        res = gen.result()
        if self.suffix_caches[method]:  # what its caches took: every committed token (a last step's past the emitted)
            self.outputs[method].append(gen.state.tokens[len(req["prompt_ids"]):])
        # checked after the first run too: lazy imports would show up only then
        self.info["torch_imported"] = "torch" in sys.modules or "transformers" in sys.modules
        return res.token_ids, res.stats["target_calls"]


def suffix_caches(export, config) -> list:
    """The cross-request suffix caches (runtime/drafters/suffix.py) a method's drafter reads:
    suffix's own, or a fused method's suffix part's."""
    from ..runtime.drafters.fused import FusedConfig, part_configs
    from ..runtime.drafters.suffix import SuffixConfig, shared_cache

    configs = part_configs(export, config).values() if isinstance(config, FusedConfig) else [config]
    caches = [shared_cache(export, c) for c in configs if isinstance(c, SuffixConfig)]
    return [c for c in caches if c is not None]


def _counting(model):
    """Wrap model.forward to count target calls (HF inspects forward's signature: keep it)."""
    import functools

    orig = model.forward
    counter = [0]

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        counter[0] += 1
        return orig(*args, **kwargs)

    model.forward = forward
    return counter


class HFGenerate:
    """transformers `generate` on a PyTorch model (hf) or an optimum ORTModelForCausalLM (optimum)."""

    def __init__(self, setup: dict):
        import torch

        threads = setup["threads"]
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass
        self.torch = torch
        method, params = setup["method"], setup.get("method_params") or {}
        if setup["system"] == "hf":
            self.model = self._torch_model(setup["target"])
        else:
            self.model = self._optimum_model(setup, threads)
        # EOS ignored, identically for every peer: an id the model cannot emit never stops
        # generation (eos_token_id=None breaks transformers' prompt-lookup path).
        self.kwargs = {"do_sample": False, "eos_token_id": setup["vocab_size"], "pad_token_id": setup["pad_token_id"]}
        if method == "draft":
            assistant = self._torch_model(setup["draft"])
            gc = assistant.generation_config
            gc.num_assistant_tokens = params["k"]  # our draft k, fixed: same work per step as ours
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            self.kwargs["assistant_model"] = assistant
        elif method == "prompt-lookup":
            self.kwargs["prompt_lookup_num_tokens"] = params["k"]
            self.kwargs["max_matching_ngram_size"] = params["max_ngram"]
        elif method != "ar":
            raise ValueError(f"{setup['system']} has no method {method!r}")
        self.calls = _counting(self.model)
        import transformers

        self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}

    def _torch_model(self, path):
        import transformers
        from transformers import AutoModelForCausalLM

        from ..export.hf_loading import check_rope_readable, read_hf_config

        check_rope_readable(path, read_hf_config(path), transformers.__version__)
        return AutoModelForCausalLM.from_pretrained(path, dtype=self.torch.float32).eval()

    def _optimum_model(self, setup, threads):
        import onnxruntime as ort
        from optimum.onnxruntime import ORTModelForCausalLM

        from .peers import optimum_model_dir

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if setup.get("ort_spinning") == "off":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = optimum_model_dir(setup["target"], setup["peers_dir"], build=True)
        return ORTModelForCausalLM.from_pretrained(path, session_options=so, provider="CPUExecutionProvider")

    def run(self, req: dict):
        torch = self.torch
        ids = torch.tensor([req["prompt_ids"]], dtype=torch.int64)
        kwargs = dict(self.kwargs)
        if req["temperature"] > 0:
            kwargs.update(do_sample=True, temperature=req["temperature"], top_k=0, top_p=1.0)
            torch.manual_seed(req.get("seed") or 0)
        self.calls[0] = 0
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_new_tokens"],
                                      **kwargs)
        new = out[0, ids.shape[1]:].tolist()
        # transformers' prompt lookup can append a token past max_new_tokens: the extra is cut, never counted
        return new[: req["max_new_tokens"]], self.calls[0]


def make_system(setup: dict):
    system = setup.get("system")
    if system in ("specdeploy", "specdeploy-int8", "specdeploy-int4"):  # the export its setup names
        return Specdeploy(setup)
    if system in ("hf", "optimum"):
        return HFGenerate(setup)
    raise ValueError(f"unknown system {system!r}")


if __name__ == "__main__":
    serve(make_system)
