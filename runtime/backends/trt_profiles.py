"""TensorRT optimization profiles from the export manifest (pure logic, no tensorrt import).

The "trt" and "ort-trt" backends bind within them; engines/builder.py builds with them.

A decoder graph record has a static token count T; its file leaves T dynamic (one
file content for every T of a model) as it does the past length P of every
`past_key.*`/`past_value.*` input ([1, P, kv_heads, head_dim]). Each record gets one
profile (an engine serving several T holds one per T, engines/builder.py):

* input_ids, position_ids [1, T] and tree_mask [1, T, T]: min = opt = max;
* past: P in [0, max_context - T].
  - min is 0, not 1: the first prefill chunk of every request (and of the draft
    model's cache) runs with an empty cache. The graph concatenates past and new
    keys along the sequence axis, and TensorRT handles that zero-volume input
    as an empty tensor. A min of 1 would force the runtime to feed a dummy past
    row, which the graph would attend to (all past is visible): wrong logits.
  - max is max_context - T: the runtime refuses a call with P + T > max_context.
  - opt is half the range: decode steps run at every past length from the prompt
    to the context end, so the middle is the neutral point to tune kernels for.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecDeployError
from ..graph_contract import DECODER, INPUT_IDS, POSITION_IDS, TREE_MASK, GraphRecord, KVGeometry, is_past, past_names
from ..manifest import Manifest


class NoProfile(SpecDeployError):
    """A graph whose dynamic dimensions we cannot bound (e.g. an EAGLE head's variable mask width)."""


@dataclass(frozen=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_json(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    def contains(self, shape) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for lo, d, hi in zip(self.min, shape, self.max))


def past_range(tokens: int, max_context: int) -> tuple[int, int, int]:
    """(min, opt, max) past length of a graph with `tokens` static tokens."""
    hi = max_context - tokens
    if hi < 0:
        raise SpecDeployError(f"a graph of {tokens} tokens does not fit max_context {max_context}")
    opt = min(hi, max(1, hi // 2)) if hi > 0 else 0
    return 0, opt, hi


def decoder_profile(tokens: int, geometry: KVGeometry, max_context: int) -> dict[str, ShapeRange]:
    fixed = lambda shape: ShapeRange(shape, shape, shape)  # noqa: E731
    past = ShapeRange(*(geometry.past_shape(p) for p in past_range(tokens, max_context)))
    out = {INPUT_IDS: fixed((1, tokens)), POSITION_IDS: fixed((1, tokens)), TREE_MASK: fixed((1, tokens, tokens))}
    out.update((name, past) for name in past_names(geometry.num_layers))
    return out


def inputs_profile(inputs: dict[str, tuple], tokens: int, max_context: int) -> dict[str, ShapeRange]:
    """A profile for any graph from its input shapes (-1 or a name marks a dynamic dim).

    Static dims are fixed; the only dynamic dim we know how to bound is the past
    length (axis 1 of past_* inputs). Anything else is an export we do not understand.
    """
    lo, opt, hi = past_range(tokens, max_context)
    out = {}
    for name, shape in inputs.items():
        dyn = [i for i, d in enumerate(shape) if not isinstance(d, int) or d < 0]
        if not dyn:
            out[name] = ShapeRange(tuple(shape), tuple(shape), tuple(shape))
            continue
        if is_past(name) and dyn == [1]:
            mk = lambda p: tuple(p if i == 1 else d for i, d in enumerate(shape))  # noqa: E731
            out[name] = ShapeRange(mk(lo), mk(opt), mk(hi))
            continue
        raise NoProfile(f"input {name} has dynamic dimensions {dyn} (shape {list(shape)}); "
                        "only the past length of past_* inputs may be dynamic")
    return out


def graph_profile(manifest: Manifest, graph: GraphRecord | str,
                  inputs: dict[str, tuple] | None = None) -> dict[str, ShapeRange]:
    """The profile of one exported graph; `inputs` (name -> shape as the network sees it)
    is cross-checked against the manifest for decoders and is required for other kinds."""
    g = manifest.graphs[graph] if isinstance(graph, str) else graph
    if g.kind != DECODER:
        if inputs is None:
            raise NoProfile(f"graph {g.name} ({g.kind}): its input shapes are needed to derive a profile")
        return inputs_profile(inputs, g.tokens, manifest.max_context)
    prof = decoder_profile(g.tokens, manifest.models[g.model].geometry, manifest.max_context)
    if inputs is not None:
        if set(inputs) != set(prof):
            extra, missing = sorted(set(inputs) - set(prof)), sorted(set(prof) - set(inputs))
            raise SpecDeployError(f"graph {g.name} inputs do not match the manifest "
                                  f"(unexpected: {extra or 'none'}, missing: {missing or 'none'})")
        for name, shape in inputs.items():
            r = prof[name]
            if len(shape) != len(r.min) or any(isinstance(d, int) and d >= 0 and not lo <= d <= hi
                                               for d, lo, hi in zip(shape, r.min, r.max)):
                raise SpecDeployError(f"graph {g.name} input {name} has shape {list(shape)}, "
                                      f"the manifest implies {list(r.max)}")
    return prof


def profile_json(profile: dict[str, ShapeRange]) -> dict:
    return {name: r.to_json() for name, r in profile.items()}
