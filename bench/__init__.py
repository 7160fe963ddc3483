"""Benchmarks: our methods beside Hugging Face, optimum and onnxruntime-genai on the same model.

`specdeploy bench OUT` runs every (system, method) in its own worker process
(`worker.py`; onnxruntime-genai's runner lives in its own venv), interleaved
prompt by prompt, and writes JSON, a Markdown table, a plot and BENCHMARKS.md.
"""
