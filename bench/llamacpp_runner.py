"""llama.cpp peer (llama-cpp-python), run by its own venv's python (see bench/llamacpp.py).

Standalone on purpose: that venv has llama-cpp-python and numpy, not specdeploy, so this
imports only `protocol` from its own folder (a script's folder is on sys.path).
Setup: {"gguf", "draft_gguf", "method", "threads", "method_params", "n_ctx", "kv_dtype", "build_note"}.
kv_dtype "float32" keeps the KV cache in float32 (as our float32 exports do; the bindings'
default is float16, which flips near-tied greedy tokens); anything else keeps the default.

Methods, through the bindings' own `Llama.generate` loop:
- ar: plain decoding;
- prompt-lookup: `LlamaPromptLookupDecoding(max_ngram_size=our max n-gram, num_pred_tokens=our k)`;
- draft: the bindings ship no model drafter, only the `LlamaDraftModel` hook, so `ModelDraft`
  drives a second `Llama` (the draft GGUF) through it: k greedy tokens per call, its KV cache
  kept over the common prefix between calls (what `Llama.generate` does on its own).
`Llama.generate` never stops at EOS (only a stopping criterion would), so EOS is ignored
as for every system; each run starts from an empty KV cache (`reset()`), as every system's does.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding
from protocol import serve

GREEDY = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def _llama(path: str, setup: dict, **kwargs) -> Llama:
    threads = setup["threads"]
    n_ctx = int(setup["n_ctx"])
    if setup.get("kv_dtype") == "float32":
        kwargs.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=threads,
                 n_threads_batch=threads, verbose=False, **kwargs)


class ModelDraft(LlamaDraftModel):
    """k greedy tokens from a draft model per call of llama-cpp-python's draft hook."""

    def __init__(self, path: str, k: int, setup: dict):
        self.llm = _llama(path, setup)
        self.k = k

    def reset(self) -> None:
        self.llm.reset()

    def __call__(self, input_ids, /, **kwargs):
        gen = self.llm.generate([int(t) for t in input_ids], reset=True, **GREEDY)  # reuses the cached prefix
        out = []
        for token in gen:
            out.append(token)
            if len(out) >= self.k:
                break
        gen.close()
        return np.asarray(out, dtype=np.intc)


class LlamaCpp:
    def __init__(self, setup: dict):
        method, params = setup["method"], setup.get("method_params") or {}
        self.draft = None
        if method == "prompt-lookup":
            self.draft = LlamaPromptLookupDecoding(max_ngram_size=int(params["max_ngram"]),
                                                   num_pred_tokens=int(params["k"]))
        elif method == "draft":
            if not setup.get("draft_gguf"):
                raise ValueError("no draft GGUF")
            self.draft = ModelDraft(setup["draft_gguf"], int(params["k"]), setup)
        elif method != "ar":
            raise ValueError(f"llama.cpp has no method {method!r} here")
        self.llm = _llama(setup["gguf"], setup, draft_model=self.draft)
        self.calls = 0
        evaluate = self.llm.eval

        def counted(tokens):  # one eval = one target pass (n_batch holds a prompt chunk or a draft)
            self.calls += 1
            return evaluate(tokens)

        self.llm.eval = counted
        features = llama_cpp.llama_print_system_info().decode(errors="replace")
        self.info = {"llama_cpp_python": llama_cpp.__version__, "gguf": setup["gguf"],
                     "kv_dtype": "float32" if setup.get("kv_dtype") == "float32" else "float16",
                     "system_info": " ".join(f for f in features.split("|") if "= 1" in f or "=1" in f)[:300],
                     "prompt_lookup": {"max_ngram_size": params.get("max_ngram"), "num_pred_tokens": params.get("k")}
                     if method == "prompt-lookup" else None,
                     "draft_k": params.get("k") if method == "draft" else None,
                     "build_note": setup.get("build_note")}  # e.g. AMX off, and why (bench/llamacpp.py)

    def run(self, req: dict):
        llm = self.llm
        n = int(req["max_new_tokens"])
        sampling = dict(GREEDY)
        if req["temperature"] > 0:
            sampling.update(temp=float(req["temperature"]), top_k=0, top_p=1.0, min_p=0.0)
            llm.set_seed(int(req.get("seed") or 0))
        llm.reset()  # else generate() would reuse the previous run's KV over a shared prefix
        if isinstance(self.draft, ModelDraft):
            self.draft.reset()
        self.calls = 0
        out = []
        gen = llm.generate([int(t) for t in req["prompt_ids"]], reset=True, **sampling)
        for token in gen:
            out.append(int(token))
            if len(out) >= n:
                break
        gen.close()
        return out, self.calls


if __name__ == "__main__":
    serve(LlamaCpp)
