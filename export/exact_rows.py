"""`export --exact-rows`: a float target's fused graphs padded as a quantized target's are.

A float32 target scores a lone row with GroupQueryAttention's one-row kernel, which differs from
the rows of a larger call by ulps (3e-5 logits on SmolLM2-135M): `ar` (one row a step) and a
method verifying k+1 rows then agree except where the target's top two logits are closer than
that (on SmolLM2's chat, code and grounded prompts the gap fell below 1e-3 at 2 of 2,304 greedy
tokens, so a flip is a matter of about one token in 10^5). With the attentions padded by one
row (export/attention_pad.py) and trees verified along their exact chain (runtime/generate.py,
the manifest's `exact_rows`), every method's greedy output is `ar`'s bit for bit on the ORT CPU
fused path, at a cost measured in README.md. The batched graph is not written: its decode rows
run the one-row kernel, batch > 1 (ONNX Runtime's CPU attention takes no padding row there).

The graph's check references gain the padding row's key and value (a copy of the call's last
row's, written one position past it), so `specdeploy check` holds the padded graph to the same
bound as the plain one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx

from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import DECODER, FUSED, PAST_LENGTH, TARGET, GraphRecord, is_present, unpadded_graph_file
from .attention_pad import can_pad, pad_attention
from .onnx_writer import files_by_content
from .reference import CHECK_DIR, load_reference, save_reference


def pad_float_target(out: Path, graphs: dict[str, GraphRecord], progress) -> dict:
    """Pad the target's fused graphs in the export staged at `out`; the manifest's `exact_rows` entry."""
    records = [g for g in graphs.values() if g.model == TARGET and g.flavor == FUSED and g.kind == DECODER]
    loaded = [(paths, onnx.load(str(paths[0]), load_external_data=False))
              for paths in files_by_content(out / g.file for g in records)]
    if not loaded or not all(can_pad(m.graph) for _, m in loaded):
        raise SpecDeployError("--exact-rows pads the target's fused GroupQueryAttention graphs, and this export "
                              "has none (drop --no-fused, or the target's family has no fused graph)")
    entry: dict = {"attention_pad": 1}
    if len(loaded) == 1:  # the one dynamic-T content, also unpadded (a CPU whose lone rows differ anyway)
        entry["unpadded_graph"] = unpadded_graph_file(TARGET)
        shutil.copyfile(loaded[0][0][0], out / entry["unpadded_graph"])  # same dir: external data resolves
    for paths, model in loaded:
        if not pad_attention(model.graph):
            raise AssertionError("an attention that can_pad accepted was not padded")
        onnx.save(model, str(paths[0]))
        data = paths[0].read_bytes()
        for other in paths[1:]:
            other.write_bytes(data)
    for g in records:
        feeds, ref = load_reference(out / CHECK_DIR, g.name)
        save_reference(out, g.name, feeds, ref.map(lambda outs, f=feeds, t=g.tokens: with_padding_row(f, outs, t)))
    progress("  target's attentions padded by one row (--exact-rows): one-row calls give the rows of any call size")
    return {"models": {TARGET: entry}}


def with_padding_row(feeds: dict, outputs: dict, tokens: int) -> dict:
    """A fused call's expected outputs once its attentions carry the padding row: each KV buffer also
    holds, one position past the call's rows, a copy of its last row (same k, v and position)."""
    past = int(np.asarray(feeds[PAST_LENGTH]).reshape(-1)[0])
    out = dict(outputs)
    for name, value in outputs.items():
        if is_present(name):
            buf = np.array(value)
            buf[0, :, past + tokens] = buf[0, :, past + tokens - 1]
            out[name] = buf
    return out
