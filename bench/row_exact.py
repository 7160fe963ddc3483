"""Which weight-only quantization schemes are row-exact on this CPU, and what a lone row costs.

    python -m specdeploy.bench.row_exact [--shapes 576x576,576x1536] [--bits 4,8] [--blocks 16,32,64]

A quantized target decodes a lone row (`ar`'s step) without a padding row only where ONNX
Runtime's MatMulNBits scores a row alone exactly as it scores it among others
(export/quantize.py, ROW_EXACT_BLOCK; the runtime checks its export on load,
runtime/backends/ort_decoder.py). The kernels are chosen per CPU, so this times one MatMulNBits
per (shape, bits, symmetric, block) on random weights, at the export's accuracy level:
whether one row alone equals the same row among 2-4, and ms per call at 1 and 2 rows. Pick
`--block-size` (and `--weights`) for the machines you deploy on from it.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DEFAULT_SHAPES = "576x576,576x1536,1536x576,576x49152"  # SmolLM2-135M's projections and LM head
TRIALS = 8  # random activation rows a scheme is probed with
REPEATS = 30  # calls timed per row count


def _session(k: int, n: int, bits: int, block: int, symmetric: bool, rng: np.random.Generator):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ..export.quantize import ACCURACY_LEVEL, quantizer_class

    weight = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "probe",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], [weight])
    # IR 8 as the exporter writes (export/fused_graph.py): onnx's newest IR is refused by older ONNX Runtimes
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    quantizer = quantizer_class()(model, bits=bits, block_size=block, is_symmetric=symmetric,
                                   accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))
    quantizer.process()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(quantizer.model.model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def probe(k: int, n: int, bits: int, block: int, symmetric: bool, seed: int = 0) -> dict:
    """{'lone_differs': rows of TRIALS scored differently alone, 'ms_1': ..., 'ms_2': ...}."""
    rng = np.random.default_rng(seed)
    session = _session(k, n, bits, block, symmetric, rng)
    differs = 0
    for _ in range(TRIALS):
        a = rng.standard_normal((4, k)).astype(np.float32)
        alone = session.run(None, {"A": a[:1]})[0][0]
        differs += any(not np.array_equal(alone, session.run(None, {"A": a[:m]})[0][0]) for m in (2, 3, 4))
    times = {}
    for m in (1, 2):
        feed = {"A": rng.standard_normal((m, k)).astype(np.float32)}
        session.run(None, feed)
        start = time.perf_counter()
        for _ in range(REPEATS):
            session.run(None, feed)
        times[f"ms_{m}"] = round(1000 * (time.perf_counter() - start) / REPEATS, 3)
    return {"lone_differs": differs, **times}


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"row_exact: --{what} takes comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="KxN weight shapes, comma-separated")
    p.add_argument("--bits", default="4,8")
    p.add_argument("--blocks", default="16,32,64")
    p.add_argument("--symmetric", action="store_true", help="also probe symmetric schemes (no zero point)")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(d) for d in s.lower().split("x")) for s in args.shapes.split(",")]
    except ValueError:
        raise SystemExit(f"row_exact: --shapes takes KxN,KxN..., got {args.shapes!r}") from None
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"row_exact: --shapes takes KxN,KxN... with K, N >= 1, got {args.shapes!r}")
    bits, blocks = _ints(args.bits, "bits"), _ints(args.blocks, "blocks")
    if not set(bits) <= {4, 8} or any(b < 16 or b & (b - 1) for b in blocks):
        raise SystemExit("row_exact: --bits are 4 or 8, --blocks powers of two >= 16")
    print(f"{'shape':>10} {'bits':>4} {'sym':>5} {'block':>5} {'lone row':>12} {'ms 1 row':>9} {'ms 2 rows':>9}")
    for k, n in shapes:
        for b in bits:
            for sym in ((False, True) if args.symmetric else (False,)):
                for block in blocks:
                    r = probe(k, n, b, block, sym)
                    verdict = "exact" if not r["lone_differs"] else f"{r['lone_differs']}/{TRIALS} differ"
                    print(f"{k}x{n:<6} {b:>4} {sym!s:>5} {block:>5} {verdict:>12} {r['ms_1']:>9} {r['ms_2']:>9}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
