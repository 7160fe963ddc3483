"""Find and start a real `tritonserver` on a model repository.

Where the server comes from, first found:
1. $SPECDEPLOY_TRITON_HOME: a Triton install dir (bin/tritonserver, backends/python/).
2. The server inside the nvidia-pytriton wheel (pytriton/tritonserver): importable, or unpacked
   with `pip install --no-deps --target DIR nvidia-pytriton` (`make serve-deps` puts it under
   build/; --no-deps because the wheel pins numpy<2) and named by $SPECDEPLOY_TRITON_HOME.
3. `tritonserver` on PATH (a stock install, e.g. NGC's container: /opt/tritonserver).

The wheel's Python backend has no stub of its own: PyTriton copies the one built for the running
Python into place at start-up. We do the same, into a backends dir of our own, and put this
interpreter's libpython first on the library path so the stub embeds the Python whose packages
the models import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from ..runtime.errors import SpecDeployError

HOME_ENV = "SPECDEPLOY_TRITON_HOME"
STUB = "triton_python_backend_stub"
_DEV_HOME = Path(__file__).resolve().parents[1] / "build" / "tritonserver" / "pytriton" / "tritonserver"


def _is_home(path: Path) -> bool:
    return (path / "bin" / "tritonserver").is_file() and (path / "backends" / "python").is_dir()


def server_home() -> Path:
    candidates = []
    if os.environ.get(HOME_ENV):
        home = Path(os.environ[HOME_ENV])
        candidates += [home, home / "pytriton" / "tritonserver"]  # the install dir, or pip's --target dir
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "tritonserver" for p in spec.submodule_search_locations]
    candidates.append(_DEV_HOME)  # `make serve-deps` in a source checkout
    on_path = shutil.which("tritonserver")
    if on_path:
        candidates.append(Path(on_path).resolve().parent.parent)
    for home in candidates:
        if _is_home(home):
            return home
    raise SpecDeployError(f"no Triton server found: set {HOME_ENV} to a Triton install, run `make serve-deps` "
                          "(the server from the nvidia-pytriton wheel), or put tritonserver on PATH")


def backend_dir(home: Path, work: Path) -> Path:
    """A backends dir whose Python backend has a stub for this interpreter."""
    if (home / "backends" / "python" / STUB).is_file():
        return home / "backends"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / STUB
    if not stub.is_file():
        raise SpecDeployError(f"this Triton has no Python-backend stub for Python {version}")
    target = work / "backends"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(home / "backends", target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, target / "python" / STUB)  # copies, not links: the loader resolves $ORIGIN from them
    return target


def command(repo: Path, work: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
            metrics_port: int = 8002, log_verbose: int = 0) -> tuple[list[str], dict]:
    """The tritonserver command line and environment."""
    home = server_home()
    backends = backend_dir(home, work)
    argv = [str(home / "bin" / "tritonserver"), f"--model-repository={repo}", f"--backend-directory={backends}",
            f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
            f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
            "--allow-gpu-metrics=false", "--exit-timeout-secs=10", f"--log-verbose={log_verbose}"]
    env = dict(os.environ)
    # This Python's libpython first; then the wheel's own libraries, which the copied stub no longer
    # finds through its relative RPATH.
    libs = [p for p in (sysconfig.get_config_var("LIBDIR"), str(home.parent.parent / "nvidia_pytriton.libs"))
            if p and Path(p).is_dir()]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return argv, env


def start(repo: Path, work: Path, log_file=None, **options) -> subprocess.Popen:
    argv, env = command(Path(repo).resolve(), Path(work), **options)
    return subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
