"""Chat messages of a request as the plain dicts chat templates expect.

The template itself is the runtime's (runtime/chat_template.py); the server renders it in
killable child processes (serve/template_sandbox.py).
"""

from __future__ import annotations

from .errors import bad_request


def message_dicts(messages) -> list[dict]:
    """Validated ChatMessages as {"role", "content"} dicts; content parts joined to text."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                      f"messages[{i}].content[{j}]", "unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and msg.role != "assistant":  # only an assistant turn (a tool call) may have none
            given = "content" in msg.model_fields_set
            raise bad_request(f"a '{msg.role}' message needs 'content' (a string or a list of text parts)"
                              f"{', not null' if given else ''}", f"messages[{i}].content",
                              "invalid_type" if given else "missing_required_parameter")
        elif content is not None and not isinstance(content, str):
            raise bad_request("message content must be a string or a list of text parts",
                              f"messages[{i}].content", "invalid_type")
        out.append({"role": msg.role, "content": content if content is not None else ""})
    return out
