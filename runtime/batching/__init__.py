"""Continuous batching: many requests as rows of one batched target graph (export/batched_graph.py).

graph.py runs the batched fused graph over a range of row slots; kv_slots.py holds the slots'
KV buffers; scheduler.py runs the rows' calls, plain steps of all rows as one call;
row_decoder.py is a row's target decoder (what a Generation runs on); batched_export.py makes
the rows and lends them to requests (Service.load(batch=N)); policy.py sizes each row's
speculation from measured call costs and acceptance.
"""
