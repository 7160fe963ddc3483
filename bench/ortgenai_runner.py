"""onnxruntime-genai peer, run by its own venv's python (see bench/peers.py).

Standalone on purpose: that venv has onnxruntime-genai and transformers>=5, not
specdeploy, so this imports only `protocol` from its own folder (a script's folder
is on sys.path). Setup: {"model_dir", "method", "threads", "method_params", "never_token_id"}.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime_genai as og
from protocol import serve


class OrtGenai:
    def __init__(self, setup: dict):
        method, params = setup["method"], setup.get("method_params") or {}
        threads = setup["threads"]
        session = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        if setup.get("ort_spinning") == "off":  # any other key is passed to ORT as a session config entry
            session["session.intra_op.allow_spinning"] = "0"
        model = {"decoder": {"session_options": session}}
        # genai has no ignore-EOS switch and wants an in-vocabulary id: a rare one the orchestrator
        # picks (bench/run.py never_token_id; not the pad id, which is the EOS in some models) stands
        # in; should the model emit it, the output is short and shows as a mismatch.
        model["eos_token_id"] = setup.get("never_token_id", setup["pad_token_id"])
        if method == "draft":
            model["draft"] = {"session_options": session}
        config = og.Config(setup["model_dir"])
        config.overlay(json.dumps({"model": model}))
        self.model = og.Model(config)
        if method == "draft":
            self.spec = {"max_draft_tokens": params["k"]}
        elif method == "prompt-lookup":
            # ngram_size = our max_ngram (3, also genai's documented starting point). Chained lookup
            # on: genai's docs advise it when continuations are shorter than k, as here; without it
            # genai's n-gram mode barely beats plain decoding on these prompts (acceptance ~1.0-1.4).
            self.spec = {"ngram_size": max(2, params["max_ngram"]), "max_draft_tokens": params["k"],
                         "ngram_chained_lookup": True}
        elif method == "ar":
            self.spec = None
        else:
            raise ValueError(f"onnxruntime-genai has no method {method!r}")
        self.info = {"onnxruntime_genai": og.__version__, "speculative": self.spec, "model_dir": setup["model_dir"]}

    def run(self, req: dict):
        ids = req["prompt_ids"]
        params = og.GeneratorParams(self.model)
        search = {"max_length": len(ids) + req["max_new_tokens"], "do_sample": False}
        if req["temperature"] > 0:
            search.update(do_sample=True, temperature=req["temperature"], top_k=0, top_p=1.0,
                          random_seed=req.get("seed") or 0)
        params.set_search_options(**search)
        if self.spec:
            params.set_speculative_options(**self.spec)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        new = [int(t) for t in gen.get_sequence(0)[len(ids):]]
        calls = len(new)
        if self.spec:
            st = gen.get_speculative_stats()
            # verify + re-anchor passes, plus plain steps taken on lookup misses
            calls = int(st["target_forward_passes"]) + int(st["standard_fallback_steps"])
        return new, calls


if __name__ == "__main__":
    serve(OrtGenai)
