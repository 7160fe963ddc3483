"""What a deployment imports: the runtime, the server and the CLI never load torch or transformers,
and the GPU backends load neither TensorRT nor torch at import (each in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_runtime_and_server_never_import_torch():
    code = ("import sys, specdeploy.runtime.service, specdeploy.runtime.aio, specdeploy.serve.app, specdeploy.cli\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_gpu_modules_import_without_tensorrt_or_torch():
    code = ("import sys\n"
            "import specdeploy.runtime.backends.trt, specdeploy.runtime.backends.ort_bound\n"
            "import specdeploy.runtime.backends.device_memory, specdeploy.runtime.backends.trt_profiles\n"
            "import specdeploy.engines.builder, specdeploy.engines.trt_check, specdeploy.engines.lint\n"
            "import specdeploy.engines.engine_manifest\n"
            "assert 'tensorrt' not in sys.modules, 'tensorrt imported at module load'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
