"""Continuous batching: many requests in one batched target graph (export/batched_graph.py).

graph.py runs the batched fused graph over a slice of row slots; kv_slots.py holds the
per-row KV buffers; batch_decoder.py steps rows of different lengths and trees together;
scheduler.py and service.py admit, step and stream requests; policy.py sizes each row's
speculation from measured costs and acceptance.
"""
