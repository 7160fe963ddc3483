"""Unit tests: pure Python and numpy on synthetic inputs (hand-built arrays, manifests, ONNX
graphs, tree files). No model build, no export, no torch: `make test-unit` runs them in seconds.

Enforced here, not just intended: a unit test that asks for a model or export fixture fails
before the fixture is built; one whose run imports torch or transformers fails; and a unit-only
session whose collection imported them (a module-level import in a unit test file, or in a
module it imports) stops with an error. What needs any of that belongs in tests/ (integration).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent
# tests/conftest.py's session fixtures that build models or exports.
MODEL_FIXTURES = frozenset({"micro_family", "micro_export", "random_models", "arch_exports", "smollm2_wheel",
                            "smollm2_4l"})
HEAVY_MODULES = ("torch", "transformers")


def _heavy_loaded() -> list[str]:
    return [m for m in HEAVY_MODULES if m in sys.modules]


def pytest_collection_finish(session):
    """Only meaningful when the session is unit tests alone: integration modules import torch."""
    if session.items and all(UNIT_DIR in Path(item.path).resolve().parents for item in session.items):
        if _heavy_loaded():
            raise pytest.UsageError(f"collecting the unit tests imported {_heavy_loaded()}: a unit test module "
                                    "(or what it imports at module level) must not")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Runs before the item's fixtures are set up, so a model is never built for a unit test."""
    built = sorted(MODEL_FIXTURES & set(item.fixturenames))
    if built:
        pytest.fail(f"unit test {item.nodeid} uses model/export fixtures {built}: it belongs in tests/ "
                    "(integration)", pytrace=False)


@pytest.fixture(autouse=True)
def _no_heavy_imports():
    before = set(_heavy_loaded())  # already loaded when `make test` ran integration tests first
    yield
    imported = sorted(set(_heavy_loaded()) - before)
    if imported:
        pytest.fail(f"this unit test imported {imported}: move it to tests/ (integration)", pytrace=False)
