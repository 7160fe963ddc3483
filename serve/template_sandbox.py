"""Chat templates rendered in child processes the server can kill.

A chat template is a program that comes with the model. Jinja's sandbox keeps it away from
the host, but not from running for hours or allocating gigabytes (`('a'*10**9)|length`,
nested loops over the messages). A thread could not be stopped and would hold the GIL, so
renders run in small long-lived child processes (jinja2 only, no model): a render past the
time limit kills its child and a fresh one takes its place; memory is capped per child.

Protocol: one JSON line per job on the child's stdin, one JSON line per answer on its stdout.
Run as `python -m specdeploy.serve.template_sandbox TOKENIZER_DIR` by the server only.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import time
from pathlib import Path

from ..runtime.chat_template import ChatTemplate, ChatTemplateError
from ..runtime.errors import SpecDeployError

MEMORY_LIMIT_BYTES = 1 << 30  # address space of one child: a normal render needs a few MB
MAX_RENDERED_CHARS = 8 << 20  # far beyond any context; stops a template from flooding the pipe
CHECK_TIMEOUT_S = 30.0  # at least this long for a child's start-up compile (`check`): Python and jinja2 load first


class TemplateTimeout(SpecDeployError):
    """The template ran past the time limit (or no render process freed up in time)."""


class TemplateFailure(SpecDeployError):
    """The render process died or ran out of memory: a fault of the template, not of the request."""


class TemplateSandbox:
    """`processes` child renderers; `render()` is blocking and thread-safe (call it off the event loop)."""

    def __init__(self, tokenizer_dir: str | Path, processes: int = 2, timeout: float = 2.0):
        self.tokenizer_dir, self.timeout = str(tokenizer_dir), float(timeout)
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._closed = False
        for _ in range(processes):
            self._idle.put(_Child(self.tokenizer_dir))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        deadline = time.monotonic() + self.timeout
        try:
            child = self._idle.get(timeout=self.timeout)
        except queue.Empty:
            raise TemplateTimeout(f"no chat template renderer became free within {self.timeout:g} s") from None
        retire = True  # unless it answers cleanly: killed on a timeout, replaced when it died
        try:
            answer = child.ask({"messages": messages, "add_generation_prompt": add_generation_prompt}, deadline)
            retire = bool(answer.get("fault"))  # out of memory or stack: not trusted with the next render
        except TemplateTimeout:
            raise TemplateTimeout(f"the chat template took longer than {self.timeout:g} s "
                                  "to render these messages") from None
        finally:
            if retire:
                child.kill()
                child = _Child(self.tokenizer_dir)
            if self._closed:
                child.kill()
            else:
                self._idle.put(child)
        if "text" in answer:
            return answer["text"]
        error = TemplateFailure if answer.get("fault") else ChatTemplateError
        raise error(answer.get("error", "the chat template failed"))

    def check(self) -> None:
        """Compile the template in a child (at start-up: compiling runs its constant expressions, e.g.
        `{{ "x" * 10**10 }}`); a SpecDeployError saying why where it does not compile within the child's
        limits. A sandbox that failed its check renders nothing: its caller closes it."""
        child = self._idle.get()
        try:
            answer = child.ask({"check": True}, time.monotonic() + max(self.timeout, CHECK_TIMEOUT_S))
        except TemplateTimeout:
            answer = {"error": f"the chat template took over {max(self.timeout, CHECK_TIMEOUT_S):g} s to compile"}
        except TemplateFailure as exc:
            answer = {"error": f"the chat template could not be compiled: {exc}"}
        if "error" in answer:
            child.kill()
            raise SpecDeployError(answer["error"])
        self._idle.put(child)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


class _Child:
    def __init__(self, tokenizer_dir: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "specdeploy.serve.template_sandbox", tokenizer_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True)
        self._buffer = b""

    def ask(self, job: dict, deadline: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(job, ensure_ascii=False).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise TemplateFailure("the chat template renderer exited") from None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TemplateTimeout("render timed out")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise TemplateFailure("the chat template renderer exited (out of memory?)")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


# -- the child ------------------------------------------------------------------------
def _answer(template: ChatTemplate, job: dict) -> dict:
    try:
        text = template.render(job["messages"], bool(job.get("add_generation_prompt", True)))
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    except MemoryError:
        return {"error": "the chat template ran out of memory", "fault": True}
    except RecursionError:
        return {"error": "the chat template recursed too deeply", "fault": True}
    if len(text) > MAX_RENDERED_CHARS:
        return {"error": f"the rendered chat prompt is over {MAX_RENDERED_CHARS} characters"}
    return {"text": text}


def main(argv: list[str]) -> int:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):  # no limit where the OS cannot set one
        pass
    template, broken = None, None
    try:  # compiling runs the template's constant expressions: here, under the memory limit
        template = ChatTemplate.from_tokenizer_dir(argv[0])
    except SpecDeployError as exc:
        broken = {"error": str(exc)}
    except MemoryError:
        broken = {"error": "the chat template ran out of memory while compiling", "fault": True}
    except RecursionError:
        broken = {"error": "the chat template nests too deeply to compile", "fault": True}
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        job = json.loads(line)
        if broken is not None:
            answer = broken
        elif template is None:
            answer = {"error": "this model has no chat template"}
        else:
            answer = {"ok": True} if job.get("check") else _answer(template, job)
        out.write(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
