"""HTTP fuzzing with schemathesis against the server's own OpenAPI document, on a real server on
loopback: whatever a client sends, the answer is never a 5xx and never a hang, and every error
is OpenAI-shaped. Bounded: few examples per operation, generations capped at 4 tokens."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from serve_util import ServerProcess, clone_export
from test_chat import CHATML

CALL_TIMEOUT_S = 20  # a request that takes longer is a hang
EXAMPLES = 30  # per operation and mode


@pytest.fixture(scope="module")
def fuzz_server(micro_export, tmp_path_factory):
    export = clone_export(micro_export, tmp_path_factory.mktemp("fuzz") / "fuzz")
    (export / "tokenizer" / "chat_template.jinja").write_text(CHATML)
    with ServerProcess(export, "--max-tokens", "4", "--pool-size", "1", "--queue", "8",
                       "--request-timeout", "15") as srv:
        yield srv


def _check(case, response) -> None:
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a GET without a body (hypothesis: "unsatisfiable")

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            _check(case, case.call(timeout=CALL_TIMEOUT_S))

        fuzz()
    assert fuzz_server.health()["in_use"] == 0
