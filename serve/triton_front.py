"""Triton model (Python backend) answering plain infer calls: one request, one response.

Triton's HTTP infer endpoint (and any client that does not stream) cannot call a decoupled
model, so the repository pairs `<name>_stream` (triton_model.py, decoupled, holds the Service)
with this thin `<name>`: it forwards each request to `<name>_stream` with `stream` false
(Triton's in-process BLS call, no second copy of the export) and returns its one response,
or its error, as is. Copied as `model.py` by triton_repo.py.
"""

from __future__ import annotations

import json

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton: nothing to run
    pb_utils = None


# A BLS call's error response arrives with code INTERNAL whatever code the model sent (Triton 2.x's Python
# backend), so a bad request answered 500; asked with this request parameter, the stream model writes its
# code before the message ("[INVALID_ARG] ..."), and it is taken back out here.
CODES_PARAMETER = "specdeploy_error_codes"


def _with_its_code(error):
    """The stream model's error as it sent it: its code (INVALID_ARG, UNAVAILABLE, INTERNAL) and message."""
    message = error.message()
    name, _, rest = message[1:].partition("] ") if message.startswith("[") else ("", "", message)
    code = getattr(pb_utils.TritonError, name, None) if name.isupper() else None
    if code is None:  # Triton's own error (the stream model gone, say): ours, as Triton reports it
        code, rest = (error.code() if hasattr(error, "code") else None), message
    return pb_utils.TritonError(rest) if code is None else pb_utils.TritonError(rest, code)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.target = config["parameters"]["stream_model"]["string_value"]
        self.outputs = [output["name"] for output in config["output"]]

    def execute(self, requests):
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        # New tensors from the values: a request's own BYTES tensors do not survive being passed on as is.
        inputs = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in request.inputs() if t.name() != "stream"]
        inputs.append(pb_utils.Tensor("stream", np.array([False])))
        call = pb_utils.InferenceRequest(model_name=self.target, requested_output_names=self.outputs, inputs=inputs,
                                         parameters={CODES_PARAMETER: True})
        answer = None
        for response in call.exec(decoupled=True):  # ends after the final response
            if response.has_error():
                return pb_utils.InferenceResponse(error=_with_its_code(response.error()))
            if response.output_tensors():
                answer = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        return answer or pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.target} gave no response"))
