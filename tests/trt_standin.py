"""A deserialized TensorRT engine played by an ONNX Runtime session over raw host pointers.

TensorRT cannot run here, so the tests drive runtime/backends/trt.py's TrtDecoder through the slice
of TensorRT's API it calls, with an engine's rules enforced: a context's input shapes must lie in
its optimization profile, every input needs a shape before execution, and a profile serves one
live context. One profile plays a one-engine-per-T layout; several play one engine for every T.
"""

from __future__ import annotations

import types

import numpy as np

# The `tensorrt` module as TrtDecoder uses it: I/O modes and dtype mapping.
FAKE_TRT = types.SimpleNamespace(TensorIOMode=types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT"),
                                 nptype=lambda dtype: dtype)
DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_}


class StandInEngine:
    def __init__(self, session, profiles):
        self.session, self.profiles, self.contexts = session, profiles, []
        self.io = [(i.name, True, i.shape, i.type) for i in session.get_inputs()] + \
                  [(o.name, False, o.shape, o.type) for o in session.get_outputs()]
        self.num_io_tensors, self.num_optimization_profiles = len(self.io), len(profiles)

    def _find(self, name):
        return next(t for t in self.io if t[0] == name)

    def get_tensor_name(self, i):
        return self.io[i][0]

    def get_tensor_mode(self, name):
        return "INPUT" if self._find(name)[1] else "OUTPUT"

    def get_tensor_dtype(self, name):
        return DTYPES[self._find(name)[3]]

    def get_tensor_shape(self, name):
        return tuple(d if isinstance(d, int) else -1 for d in self._find(name)[2])

    def create_execution_context(self):
        # TensorRT gives a new context profile 0, or none while another context holds it
        self.contexts.append(StandInContext(self, 0 if not self.contexts else None))
        return self.contexts[-1]


class StandInContext:
    def __init__(self, engine, index):
        self.engine, self.index, self.addresses, self.shapes = engine, index, {}, {}

    def set_optimization_profile_async(self, index, stream):
        if any(c.index == index for c in self.engine.contexts if c is not self):
            return False  # a profile serves one live context
        self.index, self.shapes = index, {}
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def set_input_shape(self, name, shape):
        if self.index is None or not self.engine.profiles[self.index][name].contains(shape):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def execute_async_v3(self, stream):
        io = self.engine.session.io_binding()
        tokens = self.shapes["input_ids"][1]
        for name, is_input, _, _ in self.engine.io:
            # TensorRT infers outputs' dynamic dims (batch 1, T) from the inputs
            shape = self.shapes.get(name) if is_input else (1, tokens, *self.engine.get_tensor_shape(name)[2:])
            if shape is None:
                return False  # an input without a shape: TensorRT refuses too
            bind = io.bind_input if is_input else io.bind_output
            bind(name, "cpu", 0, self.engine.get_tensor_dtype(name), shape, self.addresses[name])
        self.engine.session.run_with_iobinding(io)
        return True
