"""Edits of a parsed manifest.json that the hostile-manifest tests apply (tests/test_integrity.py
on a real export, tests/unit/test_manifest_fields.py on a hand-written one)."""

from __future__ import annotations


def set_field(*keys, value=None, drop=False):
    """A change that sets m[keys[0]]...[keys[-1]] to `value` (or deletes it with `drop`)."""
    def change(m):
        node = m
        for key in keys[:-1]:
            node = node[key]
        if drop:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return change
