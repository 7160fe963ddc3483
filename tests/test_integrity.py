"""Fault injection: crashes, damaged files and hostile manifests never lose data or load silently.

Real subprocesses and real files: `specdeploy export` killed with SIGKILL mid-run, an engines
write killed before its rename, graphs/weights/tokenizer truncated or corrupted, manifests with
traversal paths and hostile values, and --out pointed at its own inputs. Every failure is one
clear error naming the field or file; the previous export stays loadable; no input is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SPECDEPLOY, run_cli
from unit.manifest_edits import set_field

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.manifest import load_manifest, sha256_file

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (what "nothing lost" compares)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:"), proc.stderr
    for needle in needles:
        assert needle in last, (needle, last)


def generate(export: Path) -> subprocess.CompletedProcess:
    return run_cli("generate", export, "--prompt", "def f(x):", "--max-new-tokens", "4", "--ignore-eos",
                   env={"OMP_WAIT_POLICY": "PASSIVE"})


@pytest.fixture()
def export_copy(micro_export, tmp_path) -> Path:
    dst = tmp_path / "export"
    shutil.copytree(micro_export, dst)
    return dst


def edit_manifest(export: Path, change) -> None:
    path = export / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def load_error(export: Path, **kw) -> str:
    from specdeploy.runtime.loaded_export import LoadedExport

    before = snapshot(export)
    with pytest.raises(SpecDeployError) as info:
        LoadedExport(export, **kw)
    assert snapshot(export) == before  # refusing never changes the export
    message = str(info.value)
    assert "\n" not in message
    return message


# -- kill -9 during export -----------------------------------------------------------------------

def test_kill_during_export_keeps_the_previous_export(micro_family, export_copy):
    before = snapshot(export_copy)
    staging = export_copy.parent / f".{export_copy.name}.staging"
    proc = subprocess.Popen([*SPECDEPLOY, "export", "--target", str(micro_family / "target"), "--draft",
                             str(micro_family / "draft"), "--out", str(export_copy)],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not list(staging.glob("*.onnx")):
            assert proc.poll() is None, "the export finished before a graph file was seen"
            assert time.monotonic() < deadline, "no graph file appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert snapshot(export_copy) == before  # not one byte of the previous export changed
    gen = generate(export_copy)
    assert gen.returncode == 0, gen.stderr
    # The half-written export is beside it, hidden, and refused if pointed at.
    assert staging.is_dir() and list(staging.glob("*.onnx"))
    with pytest.raises(SpecDeployError, match="no manifest.json"):
        load_manifest(staging)
    assert_clean_error(generate(staging), "no manifest.json")


def test_next_run_cleans_up_what_a_killed_run_left(export_copy):
    from specdeploy.export.out_dir import OWNED, Staging, beside

    staging, old = beside(export_copy, "staging"), beside(export_copy, "old")
    staging.mkdir()
    (staging / OWNED).touch()  # as every staging directory starts
    (staging / "target_t1.onnx").write_bytes(b"half")
    said = []
    with Staging(export_copy, said.append) as stage:
        assert stage.path == staging and [p.name for p in staging.iterdir()] == [OWNED]
    assert not staging.exists() and any("interrupted" in line for line in said)
    # Killed between the two renames of the swap: OUT gone, the previous export aside.
    before = snapshot(export_copy)
    os.rename(export_copy, old)
    with Staging(export_copy, said.append):
        pass
    assert snapshot(export_copy) == before and not old.exists() and "restored" in said[-1]
    load_manifest(export_copy)
    # A new --out whose parents do not exist yet.
    fresh = export_copy.parent / "a" / "b" / "out"
    with Staging(fresh, said.append) as stage:
        (stage.path / "x").write_text("x")
        stage.publish()
    assert (fresh / "x").is_file()


@pytest.mark.parametrize("name", ["old", "staging"])
def test_a_users_directory_by_a_scratch_name_is_refused_not_removed(export_copy, name):
    """.OUT.old and .OUT.staging are removed only where an interrupted export left them (a manifest,
    or the scratch marker): a directory of the user's by that name stays, and the export says why."""
    from specdeploy.export.out_dir import Staging, beside

    mine = beside(export_copy, name)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = snapshot(export_copy)
    with pytest.raises(SpecDeployError, match="not a directory an interrupted export left"):
        with Staging(export_copy, print):
            pass
    assert (mine / "notes.txt").read_text() == "mine" and snapshot(export_copy) == before


def test_a_max_context_beyond_the_graphs_is_refused_at_load(export_copy):
    """The manifest is not checksummed: a max_context raised past the positions the fused graphs'
    RoPE tables hold is refused when the export loads, not by ONNX Runtime mid-request."""
    edit_manifest(export_copy, lambda m: m.update(max_context=m["max_context"] * 2))
    assert "max_context" in (message := load_error(export_copy)) and "exported for" in message


def test_killed_during_its_check_is_refused(export_copy):
    """A staging copy killed while its accuracy check ran says `check: pending`: never loaded."""
    edit_manifest(export_copy, lambda m: m.update(check="pending"))
    assert "pending" in load_error(export_copy)
    assert load_manifest(export_copy, allow_pending=True).check == "pending"  # the exporter's own view


def test_failed_check_publishes_nothing(micro_family, export_copy):
    from specdeploy.export.exporter import export_all

    before = snapshot(export_copy)

    def failing(manifest):
        assert manifest.check == "pending" and manifest.root.name == f".{export_copy.name}.staging"
        raise SpecDeployError("exported graphs failed the accuracy check: target_t1")

    with pytest.raises(SpecDeployError, match="accuracy check"):
        export_all(micro_family / "target", export_copy, progress=lambda m: None, check=failing)
    assert snapshot(export_copy) == before
    assert not (export_copy.parent / f".{export_copy.name}.staging").exists()
    # Passing: published, recorded as checked.
    seen = []
    export_all(micro_family / "target", export_copy, progress=lambda m: None, check=seen.append)
    assert len(seen) == 1 and load_manifest(export_copy).check == "passed"
    assert json.loads((export_copy / "manifest.json").read_text())["check"] == "passed"
    assert sorted(p.name for p in export_copy.parent.iterdir()) == [".export.lock", "export"]


def test_concurrent_writer_is_one_clear_error(micro_family, export_copy):
    from specdeploy.export.out_dir import export_lock

    before = snapshot(export_copy)
    with export_lock(export_copy):
        proc = run_cli("export", "--target", micro_family / "target", "--out", export_copy, "--no-check",
                       env={"OMP_WAIT_POLICY": "PASSIVE"})
    assert_clean_error(proc, "another `specdeploy export`")
    assert snapshot(export_copy) == before


# -- kill -9 during engines ----------------------------------------------------------------------

_STALLED_ENGINE_WRITE = """
import os, sys, time
from pathlib import Path
from specdeploy.engines.engine_manifest import atomic_write
def stall(src, dst):  # the rename never happens: killed with the new bytes in the temp file
    print("written", flush=True)
    time.sleep(600)
os.replace = stall
atomic_write(Path(sys.argv[1]), b"a newer engine" * 4096)
"""


def test_kill_during_engine_write_keeps_the_previous_engine(export_copy):
    from specdeploy.engines.engine_manifest import graph_sources, make_record, remove_partial_writes, save_engines
    from specdeploy.runtime.backends.engine_records import (
        check_engine_bytes,
        engine_rel,
        file_digests,
        load_engines,
        stale_reasons,
    )

    m = load_manifest(export_copy)
    engine = export_copy / engine_rel("target_t1")
    engine.parent.mkdir()
    blob = b"the engine that was built"
    engine.write_bytes(blob)
    digest = file_digests(export_copy)
    data = load_engines(export_copy)
    data["engines"]["target_t1"] = make_record(export_copy, m.graphs["target_t1"], graph_sources(m, "target_t1"),
                                               digest, len(blob), hashlib.sha256(blob).hexdigest(), m.dtype, {},
                                               {"tensorrt": "10.0", "gpu": "G", "compute_capability": "9.0"}, 1.0,
                                               None)
    save_engines(export_copy, data)
    before = snapshot(export_copy)
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_ENGINE_WRITE, str(engine)], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    partial = [p for p in engine.parent.iterdir() if p != engine]
    assert len(partial) == 1 and partial[0].name.startswith(".target_t1.engine.partial-")
    rec = load_engines(export_copy)["engines"]["target_t1"]
    assert engine.read_bytes() == blob and stale_reasons(export_copy, rec, digest, verify_engine=True) == []
    check_engine_bytes(rec, engine.read_bytes(), engine)
    load_manifest(export_copy)
    assert remove_partial_writes(export_copy) == partial and snapshot(export_copy) == before


def test_engine_sha256_is_checked_on_the_bytes_loaded(export_copy):
    from specdeploy.runtime.backends.engine_records import check_engine_bytes

    path = export_copy / "engines" / "target_t1.engine"
    good = b"serialized plan"
    record = {"sha256": hashlib.sha256(good).hexdigest(), "bytes": len(good)}
    check_engine_bytes(record, good, path)
    same_size = b"serialized plam"
    with pytest.raises(SpecDeployError, match="does not match its sha256.*--rebuild"):
        check_engine_bytes(record, same_size, path)


@pytest.mark.parametrize("record, needle", [
    ({"file": "../../evil.engine", "sources": {}, "bytes": 1}, "leads outside"),
    ({"file": "/etc/passwd", "sources": {}, "bytes": 1}, "absolute path"),
    ({"file": "engines/a.engine", "sources": {"../../etc/passwd": "0" * 64}, "bytes": 1}, "leads outside"),
    ({"file": "engines/a.engine", "sources": {"target_t1.onnx": "nope"}, "bytes": 1}, "sha256"),
    ({"file": "engines/a.engine", "sources": {}, "bytes": "1"}, "bytes"),
])
def test_engine_records_stay_inside_the_export(export_copy, record, needle):
    from specdeploy.runtime.backends.engine_records import load_engines

    (export_copy / "engines.json").write_text(json.dumps({"format": 1, "engines": {"target_t1": record}}))
    with pytest.raises(SpecDeployError, match=needle):
        load_engines(export_copy)


# -- damaged files -------------------------------------------------------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", ["target_t1.onnx", "draft_fused_t1.onnx", "weights/target.bin",
                                 "weights/draft.fused.bin", "tokenizer/tokenizer.json",
                                 "target_fused_batched.onnx", "weights/target.fused_batched.bin"])
@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "corrupted"])
def test_damaged_file_is_named_at_load(export_copy, rel, damage):
    damage(export_copy / rel)
    message = load_error(export_copy)
    assert "checksum mismatch" in message and rel in message


def test_damaged_graph_is_named_without_checksums(export_copy):
    """Even with checksums off (the pool's later instances), a torn graph is named, not run."""
    _truncate(export_copy / "target_t1.onnx")
    message = load_error(export_copy, verify_checksums=False)
    assert "target_t1.onnx is not a valid ONNX file" in message


def test_damaged_weights_one_clear_cli_error(export_copy):
    _flip(export_copy / "weights" / "target.bin")
    assert_clean_error(generate(export_copy), "checksum mismatch", "weights/target.bin")


# -- file references outside the export ----------------------------------------------------------

def _graph_file(path: str):
    return lambda m: m["graphs"]["target_t1"].update(file=path)


def _outside_graph(export: Path) -> str:
    outside = export.parent / "outside.onnx"
    shutil.copy(export / "target_t1.onnx", outside)  # a real graph there: only containment refuses it
    return "../outside.onnx"


@pytest.mark.parametrize("case", ["graph_dotdot", "graph_absolute", "graph_symlink", "tokenizer_dir",
                                  "tokenizer_symlink", "files_entry"])
def test_manifest_paths_stay_inside_the_export(export_copy, case):
    if case == "graph_dotdot":
        edit_manifest(export_copy, _graph_file(_outside_graph(export_copy)))
    elif case == "graph_absolute":
        edit_manifest(export_copy, _graph_file(str(export_copy.parent / _outside_graph(export_copy)[3:])))
    elif case == "graph_symlink":
        outside = export_copy.parent / _outside_graph(export_copy)[3:]
        (export_copy / "target_t1.onnx").unlink()
        (export_copy / "target_t1.onnx").symlink_to(outside)
    elif case == "tokenizer_dir":
        shutil.copytree(export_copy / "tokenizer", export_copy.parent / "tok")
        edit_manifest(export_copy, lambda m: m["tokenizer"].update(dir="../tok"))
    elif case == "tokenizer_symlink":
        shutil.move(export_copy / "tokenizer", export_copy.parent / "tok")
        (export_copy / "tokenizer").symlink_to(export_copy.parent / "tok")
    elif case == "files_entry":
        edit_manifest(export_copy, lambda m: m["files"].update({"../../../../etc/hostname": "0" * 64}))
    message = load_error(export_copy)
    assert "outside the export directory" in message or "absolute path" in message, message


def test_external_data_location_outside_is_refused(export_copy):
    """The graph itself names `../outside/target.bin` (what ONNX Runtime 1.20 reads; 1.24-1.26 still
    read such a location through a sparse initializer)."""
    import onnx

    outside = export_copy.parent / "outside"
    outside.mkdir()
    shutil.copy(export_copy / "weights" / "target.bin", outside / "target.bin")
    path = export_copy / "target_t1.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = "../outside/target.bin"
    path.write_bytes(model.SerializeToString())
    edit_manifest(export_copy, lambda m: m["files"].update({"target_t1.onnx": sha256_file(path)}))
    message = load_error(export_copy)
    assert "target_t1.onnx: external data location" in message and "outside the export" in message


def test_unlisted_file_is_refused(export_copy):
    """Every file the runtime opens is in the files map, so the checksums cover all of them."""
    edit_manifest(export_copy, lambda m: m["files"].pop("weights/target.fused.bin"))
    message = load_error(export_copy)
    assert "weights/target.fused.bin" in message and "not in the files map" in message


# -- hostile values ------------------------------------------------------------------------------

# Every field's check on a hand-written manifest: tests/unit/test_manifest_fields.py. Here a few,
# through LoadedExport on a real export: refused, the export unchanged.
HOSTILE = {
    "prefill_chunk_negative": (set_field("prefill_chunk", value=-1), "prefill_chunk"),
    "files_empty": (set_field("files", value={}), "not in the files map"),
    "graph_name_traversal": (lambda m: m["graphs"].update({"../../x": m["graphs"]["target_t1"]}), "unusable name"),
    "head_dim_missing": (set_field("models", "draft", "head_dim", drop=True), "models.draft.head_dim is missing"),
    "check_failed": (set_field("check", value="failed"), "did not pass its accuracy check"),
    # an export from another version: named as the manifest's, not as a name the user chose from a list
    "method_unknown": (lambda m: m["methods"].update(telepathy={}),
                       "lists method 'telepathy', which this version of specdeploy does not know (known: ar, "),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_value_is_one_clear_error(export_copy, case):
    change, needle = HOSTILE[case]
    edit_manifest(export_copy, change)
    message = load_error(export_copy)
    assert needle in message, message


def test_hostile_manifest_through_the_cli(export_copy):
    edit_manifest(export_copy, set_field("prefill_chunk", value=-1))
    assert_clean_error(generate(export_copy), "manifest: prefill_chunk must be between 1 and")


# -- --out must never eat an input ---------------------------------------------------------------

@pytest.fixture()
def target_copy(micro_family, tmp_path) -> Path:
    dst = tmp_path / "models" / "target"
    shutil.copytree(micro_family / "target", dst)
    return dst


def test_out_equal_to_the_target_is_refused(target_copy):
    before = snapshot(target_copy)
    proc = run_cli("export", "--target", target_copy, "--out", target_copy, env={"OMP_WAIT_POLICY": "PASSIVE"})
    assert_clean_error(proc, "is the --target input")
    assert snapshot(target_copy) == before


@pytest.mark.parametrize("where, needle", [("parent", "contains the --target"), ("inside", "is inside the --target"),
                                           ("other", "not an export directory")])
def test_out_around_an_input_or_foreign_dir_is_refused(target_copy, micro_family, where, needle):
    from specdeploy.export.exporter import export_all

    out = {"parent": target_copy.parent, "inside": target_copy / "onnx", "other": target_copy.parent.parent}[where]
    if where == "other":  # a directory with files and no manifest: not ours to replace
        target = micro_family / "target"
        (out / "notes.txt").write_text("mine")
    else:
        target = target_copy
    before = snapshot(target_copy.parent.parent)
    with pytest.raises(SpecDeployError, match=needle):
        export_all(target, out, progress=lambda m: None)
    assert snapshot(target_copy.parent.parent) == before


def test_a_tree_file_inside_out_is_refused(export_copy, micro_with_heads):
    """A tree file (--tree, or a config's `tree`) is an input too: re-exporting into the directory that
    holds it (as `tune-tree` suggests: its file lands in the export) would delete it."""
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.tree_files import TREE_DIR

    tree = export_copy / "my_tree.json"
    shutil.copy(TREE_DIR / "medusa_cpu_4.json", tree)
    before = snapshot(export_copy)
    with pytest.raises(SpecDeployError, match="contains the methods.medusa.tree input"):
        export_all(micro_with_heads / "target", export_copy, medusa=micro_with_heads / "medusa",
                   medusa_tree=str(tree), progress=lambda m: None)
    assert snapshot(export_copy) == before


def test_a_head_dir_given_as_the_draft_model_is_refused(micro_with_heads, tmp_path):
    """An EAGLE head's dir has a Llama config.json but not a causal LM's weights: transformers would
    initialise the missing ones at random and the export would ship a random draft."""
    from specdeploy.export.exporter import export_all

    out = tmp_path / "out"
    with pytest.raises(SpecDeployError, match="not a complete causal LM checkpoint: its weights lack"):
        export_all(micro_with_heads / "target", out, draft=micro_with_heads / "eagle", progress=lambda m: None)
    assert not out.exists()


def test_out_symlink_to_the_target_is_refused(target_copy, tmp_path):
    from specdeploy.export.exporter import export_all

    link = tmp_path / "link"
    link.symlink_to(target_copy)
    with pytest.raises(SpecDeployError, match="is the --target input"):
        export_all(target_copy, link, progress=lambda m: None)


# -- draft vocabulary without a tokenizer.json ---------------------------------------------------

@pytest.fixture()
def bare_draft(micro_family, tmp_path) -> Path:
    """The micro draft with no tokenizer files at all: only config.json and weights."""
    dst = tmp_path / "draft"
    shutil.copytree(micro_family / "draft", dst, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    return dst


def _check_vocab(micro_family, draft):
    from specdeploy.export.hf_loading import check_same_vocab, read_hf_config

    target = micro_family / "target"
    check_same_vocab(target, draft, read_hf_config(target), read_hf_config(draft))


def _config(draft: Path, **changes) -> None:
    cfg = json.loads((draft / "config.json").read_text())
    cfg.update(changes)
    (draft / "config.json").write_text(json.dumps(cfg))


def test_bare_draft_with_the_same_vocabulary_passes(micro_family, bare_draft):
    _check_vocab(micro_family, bare_draft)


@pytest.mark.parametrize("damage, needle", [
    (lambda d: _config(d, eos_token_id=100), "eos_token_id 100"),
    (lambda d: _config(d, bos_token_id=4096), "outside the vocabulary"),
    (lambda d: _config(d, vocab_size=None), "vocab_size"),
    (lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"2": {"content": "<|eot|>", "special": True}}})), "token 2 is '</s>'"),
    (lambda d: (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<bos>"})), "token 1 is '<s>'"),
    (lambda d: (d / "vocab.json").write_text(json.dumps({"hello": 5})), "differing entries"),
])
def test_bare_draft_mismatch_is_refused(micro_family, bare_draft, damage, needle):
    damage(bare_draft)
    with pytest.raises(SpecDeployError, match="vocabulary mismatch") as info:
        _check_vocab(micro_family, bare_draft)
    assert needle in str(info.value)


def test_bare_draft_mismatch_through_the_cli(micro_family, bare_draft, tmp_path):
    _config(bare_draft, eos_token_id=100)
    proc = run_cli("export", "--target", micro_family / "target", "--draft", bare_draft, "--out", tmp_path / "o",
                   env={"OMP_WAIT_POLICY": "PASSIVE"})
    assert_clean_error(proc, "vocabulary mismatch", "eos_token_id 100")
    assert not (tmp_path / "o").exists()
