"""Corrupt, truncated, missing and hostile checkpoints of both formats (docs/checkpoints.md, "What is checked").

Each case of the table copies one saved checkpoint, breaks it, and must be refused with one line naming the
file and the problem: through training's ``--load`` before the first forward step, and through the loader of
the inference tools (generation, the server, evaluation, HF conversion). A pickle whose loading would run
``touch SENTINEL`` must be refused without the file appearing. The command lines (training on two ranks,
``tools/generate.py``, ``convert_hf.py to-hf``, ``checkpoint_reshard.py``) print that line and exit non-zero.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_like.config import ConfigError
from megatron_like.training.checkpoint_integrity import SavedArchive, read_dcp_metadata
from megatron_like.training.checkpointing import CheckpointError
from tests.distributed.gpt_runs import BASE_FLAGS, train_gpt

ITER = "iter_0000001"
EMBEDDING = "model.embedding.word_embeddings.weight"


class Payload:
    """Unpickles as ``os.system("touch <path>")``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per format of the harness's tiny GPT after one iteration."""
    roots = {}
    for fmt in ("torch", "torch_dist"):
        roots[fmt] = tmp_path_factory.mktemp(fmt)
        train_gpt(0, 1, ["--train-iters", "1", "--save", str(roots[fmt]), "--ckpt-format", fmt])
    return roots


def flip(path: Path, start: int, count: int = 64) -> None:
    """Invert ``count`` bytes of ``path`` from ``start`` (every bit changes)."""
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def distcp_piece(it: Path, key: str) -> tuple[Path, int]:
    """(the .distcp file, where the tensor bytes of ``key``'s first saved piece start in it)."""
    metadata = read_dcp_metadata(str(it))
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    path = it / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        window = io.BytesIO(f.read(info.length))
    archive = SavedArchive(window, str(path))
    return path, info.offset + archive.data_offset("data/0")


def distcp_value(it: Path) -> tuple[Path, int]:
    """(the .distcp file, a position inside the pickled RNG state of rank 0: a plain value, not a tensor)."""
    metadata = read_dcp_metadata(str(it))
    info = next(s for i, s in metadata.storage_data.items() if i.fqn.startswith("rng."))
    return it / info.relative_path, info.offset + info.length // 8


def torch_tensor_record(path: Path) -> int:
    """Where the bytes of the largest tensor record of a torch-format file start."""
    with zipfile.ZipFile(path) as archive:
        largest = max((r for r in archive.infolist() if "/data/" in r.filename), key=lambda r: r.file_size)
    with open(path, "rb") as f:
        return SavedArchive(f, str(path)).data_offset(largest.filename.split("/", 1)[1])


def rewrite_index(it: Path, relative_path: str) -> None:
    """Point every storage entry of the index at ``relative_path`` (a copy of the real file is put there)."""
    metadata = read_dcp_metadata(str(it))
    target = (it / relative_path) if not os.path.isabs(relative_path) else None
    if target is not None:
        shutil.copyfile(it / "__0_0.distcp", target)
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    (it / ".metadata").write_bytes(pickle.dumps(metadata))


def hostile_piece(it: Path, sentinel: Path) -> None:
    """Append a torch.save archive (valid checksums) whose pickle runs the payload, and point the RNG entry at it."""
    metadata = read_dcp_metadata(str(it))
    buffer = io.BytesIO()
    torch.save({"state": Payload(sentinel)}, buffer)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn.startswith("rng."))
    path = it / info.relative_path
    info.offset, info.length = path.stat().st_size, len(buffer.getvalue())
    with open(path, "ab") as f:
        f.write(buffer.getvalue())
    (it / ".metadata").write_bytes(pickle.dumps(metadata))


def drop_storage_entry(it: Path, key: str) -> None:
    """Remove the storage entry of ``key``'s first piece from the index (an index that lost a line)."""
    metadata = read_dcp_metadata(str(it))
    del metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == key)]
    (it / ".metadata").write_bytes(pickle.dumps(metadata))


@dataclass
class Case:
    fmt: str
    name: str
    breaks: Callable[[Path, Path], None]
    """(checkpoint root, sentinel path) -> None: break the copy."""
    expected: str
    """What the one line says; ``{it}`` is the iteration directory."""
    tools: str | None = ""
    """What the tools' loader says (default: ``expected``; None: not a case for the tools)."""
    flags: tuple[str, ...] = ()


def _metadata(root: Path) -> Path:
    return root / ITER / ".metadata"


def _distcp(root: Path) -> Path:
    return root / ITER / "__0_0.distcp"


def _torch_file(root: Path) -> Path:
    return root / ITER / "mp_rank_00_000" / "model_optim_rng.pt"


def _non_utf8_tracker(root: Path, _: Path) -> None:
    (root / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe1\n")


CASES = [
    Case("torch_dist", "hostile .metadata", lambda r, s: _metadata(r).write_bytes(pickle.dumps(Payload(s))),
         "{it}/.metadata is refused: its pickle references posix.system"),
    Case("torch_dist", "storage file outside the directory", lambda r, s: rewrite_index(r / ITER, "../x.distcp"),
         "{it}/.metadata names the storage file '../x.distcp', which is not a plain .distcp file name inside"),
    Case("torch_dist", "absolute storage path", lambda r, s: rewrite_index(r / ITER, "/etc/passwd"),
         "{it}/.metadata names the storage file '/etc/passwd', which is not a plain"),
    Case("torch_dist", ".metadata of another object", lambda r, s: _metadata(r).write_bytes(pickle.dumps({"a": 1})),
         "{it}/.metadata is not a DCP index this code reads: it holds a dict"),
    Case("torch_dist", "index without a piece's storage entry", lambda r, s: drop_storage_entry(r / ITER, EMBEDDING),
         f"{{it}}/.metadata is not a DCP index this code reads: {EMBEDDING}'s piece at [0, 0] has no storage entry"),
    Case("torch_dist", "truncated .metadata", lambda r, s: cut(_metadata(r), 0.5),
         "{it}/.metadata is truncated or not a DCP index"),
    Case("torch_dist", "zero-byte .metadata", lambda r, s: cut(_metadata(r), 0), "{it}/.metadata is empty (0 bytes)"),
    Case("torch_dist", "missing .metadata", lambda r, s: _metadata(r).unlink(),
         "{it} holds torch_dist pieces but no .metadata index",
         tools="{it}/mp_rank_00_000/model_optim_rng.pt is missing"),
    Case("torch_dist", "missing .distcp", lambda r, s: _distcp(r).unlink(),
         "{it}/__0_0.distcp is missing (its .metadata names it)"),
    Case("torch_dist", "truncated .distcp", lambda r, s: cut(_distcp(r), 0.5), "{it}/__0_0.distcp is truncated: "),
    Case("torch_dist", "zero-byte .distcp", lambda r, s: cut(_distcp(r), 0), "{it}/__0_0.distcp is truncated: 0 bytes"),
    Case("torch_dist", "64 bytes of a tensor overwritten", lambda r, s: flip(*distcp_piece(r / ITER, EMBEDDING)),
         f"{{it}}/__0_0.distcp (piece {EMBEDDING} at [0, 0]) is corrupt: its record data/0 fails its CRC-32"),
    Case("torch_dist", "64 bytes of a plain value overwritten", lambda r, s: flip(*distcp_value(r / ITER)),
         "{it}/__0_0.distcp (piece rng.tp0.pp0.dp0) is corrupt: its record", tools=None),
    Case("torch_dist", "hostile pickle in a piece", lambda r, s: hostile_piece(r / ITER, s),
         "checkpoint {it} is refused: a piece's pickle holds objects other than tensors", tools=None),
    Case("torch_dist", "missing common.pt", lambda r, s: (r / ITER / "common.pt").unlink(),
         "{it}/common.pt is missing"),
    Case("torch_dist", "hostile common.pt", lambda r, s: torch.save({"config": Payload(s)}, r / ITER / "common.pt"),
         "{it}/common.pt is refused: its pickle holds a reference to posix.system"),
    Case("torch_dist", "another vocabulary", lambda r, s: None,
         f"checkpoint {{it}} holds {EMBEDDING} with 256 rows (a vocabulary of 249 to 256 tokens, padded to a multiple "
         "of 8), this model has 304 (a vocabulary of 297 to 304): a different vocabulary", tools=None,
         flags=("--vocab-size", "300")),
    Case("torch_dist", "tracker with non-UTF-8 bytes", _non_utf8_tracker, "holds b'\\xff\\xfe1', not an iteration"),
    Case("torch", "hostile pickle", lambda r, s: torch.save({"iteration": 1, "config": {}, "model": [Payload(s)]},
                                                            _torch_file(r)),
         "{it}/mp_rank_00_000/model_optim_rng.pt is refused: its pickle holds a reference to posix.system"),
    Case("torch", "truncated file", lambda r, s: cut(_torch_file(r), 0.5),
         "{it}/mp_rank_00_000/model_optim_rng.pt is truncated or not a torch checkpoint"),
    Case("torch", "zero-byte file", lambda r, s: cut(_torch_file(r), 0),
         "{it}/mp_rank_00_000/model_optim_rng.pt is truncated or not a torch checkpoint"),
    Case("torch", "missing file", lambda r, s: _torch_file(r).unlink(),
         "{it}/mp_rank_00_000/model_optim_rng.pt is missing"),
    Case("torch", "64 bytes of a tensor overwritten",
         lambda r, s: flip(_torch_file(r), torch_tensor_record(_torch_file(r))),
         "{it}/mp_rank_00_000/model_optim_rng.pt is corrupt: its record data/"),
    Case("torch", "another vocabulary", lambda r, s: None,
         "embedding.word_embeddings.weight has shape (256, 64), this model has (304, 64)", tools=None,
         flags=("--vocab-size", "300")),
    Case("torch", "tracker with non-UTF-8 bytes", _non_utf8_tracker, "holds b'\\xff\\xfe1', not an iteration"),
]


def broken(saved: dict[str, Path], case: Case, tmp_path: Path) -> tuple[Path, Path, str]:
    """(the broken copy, the sentinel the payload would create, the expected text with paths filled in)."""
    root, sentinel = tmp_path / "ckpt", tmp_path / "PAYLOAD_RAN"
    shutil.copytree(saved[case.fmt], root)
    case.breaks(root, sentinel)
    return root, sentinel, case.expected.replace("{it}", str(root / ITER))


def assert_one_line(message: str, expected: str) -> None:
    assert "\n" not in message and "Traceback" not in message and "weights_only" not in message, message
    assert expected in message, f"expected {expected!r} in {message!r}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.fmt}: {c.name}")
def test_training_load_refuses_before_any_step(saved, case, tmp_path):
    root, sentinel, expected = broken(saved, case, tmp_path)
    steps = []

    def forward_step(*args, **kwargs):
        import pretrain_gpt

        steps.append(1)
        return pretrain_gpt.forward_step(*args, **kwargs)

    with pytest.raises((CheckpointError, ConfigError)) as refused:  # ConfigError: the tracker, checked up front
        # A longer run than the saved one changes the lr schedule: Megatron's rule wants it said.
        train_gpt(0, 1, ["--train-iters", "2", "--override-opt_param-scheduler", "--load", str(root), *case.flags],
                  forward_step=forward_step)
    assert_one_line(str(refused.value), expected)
    assert not steps and not sentinel.exists()


@pytest.mark.parametrize("case", [c for c in CASES if c.tools is not None], ids=lambda c: f"{c.fmt}: {c.name}")
def test_tools_loader_refuses(saved, case, tmp_path):
    """``load_full_state``: what generation, the server, evaluation and HF conversion read a checkpoint with."""
    from megatron_like.model.state import load_full_state

    root, sentinel, expected = broken(saved, case, tmp_path)
    with pytest.raises(RuntimeError) as refused:
        load_full_state(str(root))
    assert_one_line(str(refused.value), case.tools.replace("{it}", str(root / ITER)) if case.tools else expected)
    assert not sentinel.exists()


def test_a_checkpoint_saved_without_checksums_loads_with_a_notice(saved, tmp_path, capsys):
    """torch.save with CRC-32 off writes zeros: such a file (an old or foreign checkpoint) loads, saying so."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved["torch"], root)
    state = torch.load(_torch_file(root), weights_only=True)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, _torch_file(root))
    finally:
        torch.serialization.set_crc32_options(True)
    train_gpt(0, 1, ["--train-iters", "2", "--override-opt_param-scheduler", "--load", str(root)])
    assert f"checkpoint file {_torch_file(root)} was saved without checksums" in capsys.readouterr().out


def _cli_case(saved: dict[str, Path], fmt: str, name: str, tmp_path: Path) -> tuple[Path, Path, str]:
    return broken(saved, next(c for c in CASES if c.fmt == fmt and c.name == name), tmp_path)


@pytest.mark.parametrize("fmt, name", [("torch_dist", "hostile .metadata"),
                                       ("torch_dist", "64 bytes of a tensor overwritten"),
                                       ("torch", "64 bytes of a tensor overwritten")])
def test_training_command_line_prints_one_line_on_every_rank(saved, fmt, name, tmp_path):
    from tests.distributed.harness import run_distributed
    from tests.e2e.cli import _run_script_rank

    root, sentinel, expected = _cli_case(saved, fmt, name, tmp_path)
    flags = BASE_FLAGS + ["--override-opt_param-scheduler", "--load", str(root)]
    results = run_distributed(_run_script_rank, 2, "pretrain_gpt.py", flags, True, False, timeout=120)
    for code, out, err in results:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
        assert not re.search(r"^ *iteration +\d+/", out, re.MULTILINE), out  # nothing trained (no log line)
    assert not sentinel.exists()


@pytest.mark.parametrize("tool", ["generate", "convert_hf", "checkpoint_reshard"])
@pytest.mark.parametrize("fmt, name", [("torch_dist", "hostile .metadata"), ("torch_dist", "missing .distcp"),
                                       ("torch", "64 bytes of a tensor overwritten")])
def test_tools_command_lines_print_one_line(saved, tool, fmt, name, tmp_path, monkeypatch, capsys):
    from tests.e2e.cli import run_script

    root, sentinel, expected = _cli_case(saved, fmt, name, tmp_path)
    out_dir = tmp_path / "out"
    if tool == "checkpoint_reshard":  # in this process; its torchrun passes forked from the harness
        import sys
        import types

        from tests.e2e.cli import ROOT, forked_torchrun_command

        sys.path.insert(0, str(ROOT / "tools"))
        import checkpoint_reshard

        monkeypatch.setattr(checkpoint_reshard, "subprocess", types.SimpleNamespace(run=forked_torchrun_command))
        target = "torch_dist" if fmt == "torch" else "torch"
        code = checkpoint_reshard.main(["--load", str(root), "--save", str(out_dir), "--ckpt-format", target])
        err = capsys.readouterr().err
    else:
        argv = {"generate": ["tools/generate.py", "--load", root, "--prompt-ids", "1 2 3", "--max-new-tokens", "2",
                             "--greedy"],
                "convert_hf": ["tools/convert_hf.py", "to-hf", "--load", root, "--save", out_dir]}[tool]
        result = run_script(*argv, check=False, timeout=120)
        code, err = result.returncode, result.stderr + result.stdout
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code != 0 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
    assert not sentinel.exists() and not (out_dir / ITER).exists()


def test_a_piece_broken_for_one_rank_only_stops_every_rank_at_the_load(tmp_path):
    """torch format at dp 2: only rank 1 reads optim_rng_dp_001.pt (its generators). Its bytes fail their checksum
    when the load reads them: rank 0, whose files are sound, stops with rank 1's line instead of training alone."""
    from tests.distributed.harness import run_distributed

    root = tmp_path / "ckpt"
    run_distributed(train_gpt, 2, ["--train-iters", "1", "--save", str(root), "--ckpt-format", "torch"], timeout=120)
    own = root / ITER / "mp_rank_00_000" / "optim_rng_dp_001.pt"
    flip(own, torch_tensor_record(own))
    results = run_distributed(_load_and_report, 2, root, timeout=120)
    assert results[0] == results[1] and results[0].startswith(f"checkpoint file {own} is corrupt"), results


def _load_and_report(rank: int, world_size: int, root: Path) -> str:
    try:
        train_gpt(rank, world_size, ["--train-iters", "2", "--override-opt_param-scheduler", "--load", str(root),
                                     "--distributed-timeout-minutes", "0.3"])
    except CheckpointError as error:
        return str(error)
    return "trained"


@pytest.mark.parametrize("what", ["a file", "a tracker with non-UTF-8 bytes"])
def test_load_paths_are_one_line_before_any_process_group(what, tmp_path, capsys, monkeypatch):
    from tests.unit.test_input_errors import FLAGS, stderr_of_main

    if what == "a file":
        load = tmp_path / "model_optim_rng.pt"
        load.write_bytes(b"x")
        expected = f"--load {load} is a file; pass the checkpoint directory"
    else:
        load = tmp_path
        _non_utf8_tracker(tmp_path, tmp_path)
        expected = "latest_checkpointed_iteration.txt holds b'\\xff\\xfe1', not an iteration number"
    code, err = stderr_of_main(FLAGS + ["--load", str(load)], capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_generation_stops_every_pipeline_stage_when_one_stage_reads_a_broken_piece(saved, tmp_path):
    """tools/generate.py at pp 2: only the second stage reads layer 3. Its piece fails its checksum on rank 1;
    rank 0, whose layers are sound, stops with rank 1's line instead of waiting for it in generation."""
    from tests.distributed.harness import run_distributed
    from tests.e2e.cli import _run_script_rank

    root = tmp_path / "ckpt"
    shutil.copytree(saved["torch_dist"], root)
    broken_piece, start = distcp_piece(root / ITER, "model.layers.3.mlp.fc1.weight")
    flip(broken_piece, start)
    argv = ["--load", str(root), "--pipeline-model-parallel-size", "2", "--prompt-ids", "1 2 3",
            "--max-new-tokens", "2", "--greedy", "--distributed-timeout-minutes", "0.3"]
    results = run_distributed(_run_script_rank, 2, "tools/generate.py", argv, True, False, timeout=120)
    lines = [[line for line in err.splitlines() if line.startswith("error: ")] for _, _, err in results]
    assert [code for code, _, _ in results] == [2, 2], results
    assert len(lines[0]) == 1 and "model.layers.3.mlp.fc1.weight" in lines[0][0] and "is corrupt" in lines[0][0], lines
