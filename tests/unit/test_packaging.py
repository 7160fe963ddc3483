"""pyproject.toml: dependency floors that keep known-unsafe releases out."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dependency_floors_exclude_known_unsafe_releases():
    """torch < 2.10: weights_only loading bypasses (CVE-2025-32434, CVE-2026-24747); onnxruntime
    before the external-data containment fixes follows `../` locations (see pyproject.toml)."""
    text = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.10,' in text
    assert '"onnxruntime>=1.27,' in text and '"onnxruntime-gpu>=1.27,' in text
