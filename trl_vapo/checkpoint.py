"""Saving what a VAPOTrainer trains: models, model card, the pretrained critic, and crash-safe checkpoints.

A checkpoint is written into a temporary sibling folder and renamed into place only when complete, so a crash (or
`kill -9`) while writing leaves the previous checkpoint untouched and no half-written folder that looks valid.
Random-number states go to safetensors plus JSON: nothing in a checkpoint needs pickle to load except the optimizer
and scheduler state dicts, which load with `torch.load(weights_only=True)`. `SavingMixin` holds the trainer's
saving and resuming methods, so that `trainer.py` reads as the training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import functools
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import zipfile
from argparse import ArgumentTypeError
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.logging import get_logger
from safetensors.torch import load_file, save_file
from transformers.hf_argparser import string_to_bool
from transformers.trainer_callback import ExportableState, TrainerState

from ._compat import get_config_model_id
from .diagnostics import strict_json
from .distributed import (
    decided_on_main,
    fsdp2_optimizer_state,
    gathered_state_dict,
    load_fsdp2_optimizer_state,
    load_placed_state_dict,
    placed_state_dict,
    stepping_optimizer,
)
from .metric_names import VALUE_PRETRAIN
from .model_card import VAPO_CITATION, RunRecord, build_model_card
from .modeling import (
    CRITIC_SUBFOLDER,
    POLICY_ADAPTER,
    VALUE_HEAD_FILE,
    VALUE_PRETRAINING_FILE,
    is_peft_model,
    value_pretraining_record,
)
from .reporting import tracker_urls
from .rollout import load_rollouts, save_rollouts
from .run import TrainingProgress
from .signals import stop_signals_held

logger = get_logger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
PRETRAINED_CRITIC_DIR = "value_pretrained_critic"
DEEPSPEED_CHECKPOINT_TAG = "deepspeed"
COMPLETE_MARKER = "vapo_state.json"
RUN_CONFIG_FILE = "vapo_config.json"  # the VAPOConfig, beside every saved model (`trl-vapo eval` reads it)
RUN_DATA_FILE = "vapo_script_args.json"
"""What `trl-vapo train` was given beside its VAPOConfig (its data and reward flags: `run_script_args`), written with
every model it saves, for `trl-vapo eval`."""
# A checkpoint's tensors that only a resume reads, in safetensors files of their own: in a folder of their own, since
# a model loader that takes every *.safetensors beside config.json (vLLM's) read them as the policy's weights.
TRAINING_STATE_DIR = "training_state"
# With sync_ref_model the KL penalty's reference moves with the policy (TR-DPO): a resume needs it as it was.
REFERENCE_FILE = "reference_model.safetensors"
SCALER_FILE = "scaler.pt"  # fp16's loss scaler (accelerate's name)
# Value pretraining's replay window (`value_pretrain_replay`), each process's own rollouts.
REPLAY_FILE = "value_pretrain_replay_{}.safetensors"
RNG_FILE = "rng_state_{}.safetensors"  # each process's random-number states
# A checkpoint's files that only a resume reads: the model pushed to the Hub's root leaves them out (the tensors'
# names at the checkpoint's root are where checkpoints written before TRAINING_STATE_DIR hold them).
TRAINING_STATE = [
    "optimizer.pt",
    "scheduler.pt",
    SCALER_FILE,
    f"{TRAINING_STATE_DIR}/*",
    RNG_FILE.format("*"),
    REPLAY_FILE.format("*"),
    "trainer_state.json",
    REFERENCE_FILE,
    COMPLETE_MARKER,
]
TRAINING_STATE += [f"{DEEPSPEED_CHECKPOINT_TAG}/*", "latest", "zero_to_fp32.py"]  # ZeRO's state and its pointers
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
"""A PEFT adapter's files: a full model saved where an earlier save left them removes them, or `from_pretrained`
(and `trl-vapo eval`) would load the adapter on its base instead of the model. (An adapter saved over a full model's
weights leaves them: its config names what loads, and the folder may be the base model's own.)"""
WEIGHT_FILES = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)
"""A full model's weights as `save_pretrained` writes them, sharded or not (glob patterns)."""
HUB_WEIGHT_FILES = [*WEIGHT_FILES, *ADAPTER_FILES, f"{CRITIC_SUBFOLDER}/*"]
"""The policy's weight files and the critic's folder in the Hub repository's root, which each push there replaces
(`delete_patterns`: those the push does not upload go): a checkpoint's, pushed while training, in its float32
training weights, may be shards of another count than the final model's, and their index, left beside the final
`model.safetensors`, is what vLLM loads; an adapter's files left by an earlier run of LoRA, beside a full model, are
what `from_pretrained` loads (as `save_model` removes them from `output_dir`)."""


def remove_debris(
    output_dir: str | os.PathLike, dead_runs_only: bool = False
) -> tuple[list[str], list[str], list[str]]:
    """Remove the half-written folders (`.checkpoint-N.<run>.tmp`, `.old`, a `save_model`'s
    `.save_model.<run>.tmp`: a full model each) that runs stopped mid-write left in `output_dir`, and the rotated
    checkpoints they stopped removing (`.checkpoint-N.<run>.del`); while holding its lock, when no other run can be
    writing them, or, where it cannot be locked, with `dead_runs_only`: only those of runs of this host that are gone
    (`<run>` is the main process's host and PID; a job a launcher kills mid-checkpoint at each preemption left a full
    checkpoint's folder each time, kept for good). A checkpoint (or the value-pretrained critic) that a stop left
    whole goes in place instead: a `.tmp` whose record was written and whose every file reads (stopped while
    `publish` flushed it to the disk, before its renames), else an `.old` that a stop between `publish`'s two renames
    left without its replacement. Returns the names removed, those restored (`.old`) and those published (`.tmp`)."""
    removed, restored, published = [], [], []
    for folder, name, kind, whole in _debris(output_dir):
        if dead_runs_only and not _of_a_run_gone_from_this_host(folder):
            continue
        final = Path(output_dir) / name
        if kind == "tmp" and whole and _publishable(folder, name):
            publish(folder, final)  # over a folder of the same step too: the one it was written to replace
            published.append(final.name)
            continue
        if kind == "old" and whole and not final.exists():
            # `publish` stopped between its two renames: the folder it replaced is whole, and back in place.
            os.replace(folder, final)
            restored.append(final.name)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return sorted(removed), restored, published


_DEBRIS = re.compile(rf"^\.({CHECKPOINT_PREFIX}-\d+|{PRETRAINED_CRITIC_DIR}|save_model)(\..+)?\.(tmp|old|del)$")
r"""A half-written folder's name, or a half-removed one's (`.del`: a rotated checkpoint): `(\..+)?` is the run's name
(folders of trl-vapo before per-run names have none)."""


def _of_a_run_gone_from_this_host(folder: Path) -> bool:
    """Whether the debris `folder` names (`run_owner`) a process of this host that is gone; not one named otherwise."""
    from .run_lock import alive

    owner = (_DEBRIS.match(folder.name)[2] or "")[1:]
    host, _, pid = owner.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    # (its PID this run's now: the run that wrote it is gone)
    return not alive(int(pid)) or int(pid) == os.getpid()


def _debris(output_dir: str | os.PathLike) -> list[tuple[Path, str, str, bool]]:
    """The half-written folders in `output_dir` (`remove_debris`), each `(folder, final name, "tmp", "old" or "del",
    whether its record was written)`, each folder's `.tmp` before its `.old`: the newer write, when whole, replaces the
    one it was replacing."""
    found = [p for p in Path(output_dir).glob(".*") if p.is_dir() and _DEBRIS.match(p.name)]
    found.sort(key=lambda p: (_DEBRIS.match(p.name)[1], _DEBRIS.match(p.name)[3] != "tmp", p.name))
    debris = []
    for folder in found:
        name, _, kind = _DEBRIS.match(folder.name).groups()
        # Each folder's record, written last: a folder half removed may have lost it.
        record = COMPLETE_MARKER if name.startswith(CHECKPOINT_PREFIX) else VALUE_PRETRAINING_FILE
        debris.append((folder, name, kind, name != "save_model" and (folder / record).is_file()))
    return debris


def checkpoints_to_publish(output_dir: str | os.PathLike) -> list[str]:
    """The checkpoints a stop left whole before their renames, which `remove_debris` publishes once the run holds
    `output_dir` (over a folder of the same step, if any: the one it was written to replace)."""
    return [
        name
        for folder, name, kind, whole in _debris(output_dir)
        if kind == "tmp" and whole and name.startswith(CHECKPOINT_PREFIX) and _publishable(folder, name)
    ]


def _publishable(folder: Path, name: str) -> bool:
    """Whether a `.tmp` folder that a stop left with its record written reads whole: the record comes last, after
    every process wrote its files, but their flush to the disk (`publish`) may not have ended before a power loss.
    (An `.old` was published, flushed, before it was set aside.)"""
    if not name.startswith(CHECKPOINT_PREFIX):
        return unreadable_file(folder) is None
    try:
        model_only = read_marker(folder).get("model_only", False)
    except (OSError, ValueError):  # a damaged marker
        return False
    # A `save_only_model` checkpoint is one to publish, not to resume from: its files need only read.
    return unreadable_file(folder) is None if model_only else checkpoint_problem(folder) is None


def run_owner() -> str:
    """This process's part of a temporary folder's name (host and PID): runs never share a temporary folder."""
    return f"{socket.gethostname()}-{os.getpid()}"


SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""A write refused for room: a full disk, a quota, a file-size limit."""
WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter", "file write failed", "No space left", "I/O error")
"""What torch's archive writer says when a write fails (a full disk reads "inline_container.cc ... unexpected pos"),
and safetensors' ("Error while serializing: I/O error: No space left on device (os error 28)")."""
SPACE_FAILURES = ("unexpected pos", "file write failed", *(f"(os error {n})" for n in sorted(SPACE_ERRNOS)))
"""Those of `WRITE_FAILURES` that mean a write refused for room: torch's archive writer names no cause, safetensors
the error's number (its "I/O error" is also a folder gone: "No such file or directory (os error 2)")."""


@contextlib.contextmanager
def write_errors_named(final: Path, tmp: Path):
    """A checkpoint that could not be written (a full disk, a quota, a lost mount) as an error naming it, the space
    left and what is intact; its half-written folder `tmp` is removed, which frees the space it took."""
    from safetensors import SafetensorError  # every weights file (policy, critic, reference, random state) is one

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as error:
        text = str(error)
        if not isinstance(error, OSError) and not any(sign in text for sign in WRITE_FAILURES):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(final.parent).free / 2**30
        intact = ", ".join(c.name for c in list_checkpoints(final.parent)[-2:]) or "none"
        first_line = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
        # A write that ran out of room, or one the writers name only as failed: space. Else (no permission, a folder
        # gone, a lost mount) what the error says, not a full disk.
        space = getattr(error, "errno", None) in SPACE_ERRNOS or any(sign in text for sign in SPACE_FAILURES)
        cause = (
            f"{free:.1f} GiB are free there: a full disk? The checkpoints written before ({intact}) are intact. Free "
            "some space (save_total_limit keeps fewer checkpoints)"
            if space
            else f"the checkpoints written before ({intact}) are intact. Make the folder writable by this process"
        )
        raise OSError(
            f"Writing {final.name} in {final.parent} failed ({first_line}); {cause}, then resume with "
            "resume_from_checkpoint=True."
        ) from error


def room_for_checkpoints(newest: Path, args, step: int, max_steps: int) -> str | None:
    """What to say when the checkpoints a run has yet to write (every `save_steps` to `max_steps`, each as large as
    `newest`, at most `save_total_limit` kept) need more room than the disk has free: said at the first, hours before
    a save fails on a full disk (transformers keeps every checkpoint by default; a full fine-tuning's holds the policy,
    the critic and their optimizer state, ~11 GiB at 0.5B parameters). None where they fit."""
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "steps" or not args.save_steps:
        return None
    every = args.save_steps if args.save_steps >= 1 else math.ceil(max_steps * args.save_steps)  # (< 1: a ratio)
    coming = -(-max(0, max_steps - step) // max(1, int(every)))  # (the run's last step saves too)
    kept = coming if args.save_total_limit is None else min(coming, args.save_total_limit)
    size = sum(file.stat().st_size for file in newest.rglob("*") if file.is_file())
    free = shutil.disk_usage(newest.parent).free
    if kept * size <= free:
        return None

    def gib(size: float) -> str:
        return f"{size / 2**30:,.1f} GiB" if size >= 2**30 / 10 else f"{size / 2**20:,.0f} MiB"

    unset = args.save_total_limit is None
    keeping = "all kept: save_total_limit is unset" if unset else "those save_total_limit keeps"
    return (
        f"{newest.name} takes {gib(size)}, and the {coming:,} checkpoints still to come ({keeping}) need about "
        f"{gib(kept * size)} where {gib(free)} are free ({newest.parent}): the disk would fill mid-run. Set "
        "save_total_limit (2 keeps the last two) or a larger save_steps, or free some space."
    )


def temporary_folder(final: Path, owner: str) -> Path:
    """The folder a checkpoint is assembled in before :func:`publish` renames it to ``final``: named for its run
    (`owner`, :func:`run_owner` of the run's main process), so that no other run can remove it mid-write."""
    return final.with_name(f".{final.name}.{owner}.tmp")


def flush_file_mode() -> str:
    """How a file is opened to be flushed: Windows flushes a file only through a handle that may write
    (FlushFileBuffers); POSIX flushes any handle."""
    return "r+b" if os.name == "nt" else "rb"


def flushes_folders() -> bool:
    """Whether folders are flushed: POSIX, to make a rename durable; Windows can neither open a folder nor flush one
    (NTFS journals a rename itself)."""
    return os.name != "nt"


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, and the folders themselves, to the disk: the rename that publishes a
    checkpoint must not reach the disk before its files' contents do (a power loss would leave zero-byte files)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), flush_file_mode()) as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    if not flushes_folders():
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        # A file system that cannot flush a folder (CIFS, some FUSE mounts): its files are flushed, and a failed
        # flush after the renames failed a checkpoint that was in place (SQLite ignores these errors too).
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically replace ``final`` with the complete folder ``tmp``, its contents on the disk first."""
    fsync_tree(tmp)
    if final.exists():
        stale = tmp.with_suffix(".old")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)  # the rename itself


def write_marker(folder: Path, marker: dict) -> None:
    """The completion marker of the checkpoint `folder`, whole or not at all: written beside it, on the disk, then
    renamed in place (the `.tmp` beside it is passed over by the checks: `unreadable_file`). Rewritten in place at an
    epoch's end, a power loss before its flush (XFS) left the run's last checkpoint with an empty marker, which no
    resume could read; written in place in a checkpoint's temporary folder, a stop between the file's creation and
    its write left one that looked complete (the resume's own check passed it over as unreadable)."""
    write_whole(folder, COMPLETE_MARKER, lambda written: written.write_text(json.dumps(marker, indent=2)))


REWRITTEN_IN_PLACE = (COMPLETE_MARKER, "trainer_state.json")
"""The files of a published checkpoint rewritten at an epoch's end (`_record_epoch_end`), by `write_whole`."""


def _json(value: Any) -> str:
    """`value` as JSON, for comparing what a JSON file holds with what it would hold (NaN as its text: NaN != NaN)."""
    return json.dumps(value, sort_keys=True, default=str)


def write_whole(folder: Path, name: str, write: Callable[[Path], None]) -> None:
    """The file `name` of the checkpoint `folder`, whole or not at all: `write` writes it beside it (`.<name>.tmp`,
    which the checks pass over: `unreadable_file`), on the disk, then it is renamed in place."""
    written = folder / f".{name}.tmp"
    try:
        write(written)
        with open(written, flush_file_mode()) as file:
            os.fsync(file.fileno())
        os.replace(written, folder / name)
    except BaseException:
        written.unlink(missing_ok=True)
        raise


def read_marker(path: Path) -> dict:
    """The completion marker of the checkpoint folder ``path`` (its progress, run fingerprint and inputs); a clear
    error when the folder is not a complete checkpoint."""
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        raise ValueError(
            f"{path} is not a complete trl-vapo checkpoint (no {COMPLETE_MARKER}); complete ones in its folder: "
            f"{[c.name for c in list_checkpoints(Path(path).parent)]}."
        )
    content = json.loads(marker.read_text())
    if not isinstance(content, dict):
        raise ValueError(f"{marker} is damaged: a JSON {type(content).__name__}, not the object a checkpoint writes.")
    return content


RESUME_IF_ANY = "auto"
"""`resume_from_checkpoint="auto"`: the newest checkpoint where `output_dir` holds one, else a fresh run; the one
setting a preemptible job needs, requeued before or after its first checkpoint."""


def resume_request(resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """`resume_from_checkpoint` as given in Python or on the command line: True for True, "latest" and the words
    transformers' parser reads as true ("true", "yes", "1", ...); None for None, False, "none", "" and the words it
    reads as false ("false", "no", "0", ...); `RESUME_IF_ANY` for "auto"; else the path it names. (A folder named
    "latest" or "no", say, is that folder.)"""
    value = resume_from_checkpoint
    if isinstance(value, str) and (not value or not Path(value).exists()):
        word = value.lower()
        if word in ("latest", "none", "", RESUME_IF_ANY):
            return {"latest": True, RESUME_IF_ANY: RESUME_IF_ANY}.get(word)
        with contextlib.suppress(ArgumentTypeError):  # not one of the parser's words: a path
            return True if string_to_bool(word) else None
    return None if value is False else value


def resolve_resume(
    output_dir: str | os.PathLike, request: str | bool | None, warn: bool = True, before_lock: bool = False
) -> str | None:
    """The checkpoint a `resume_request` answer names in `output_dir`: a path as given; for True the newest one that
    reads (`warn`: name each damaged newer one), or, `before_lock` (the run does not hold `output_dir` yet), None
    where there is none yet but one a stop left whole before its renames (`checkpoints_to_publish`, which taking the
    lock publishes: `SavingMixin.resume_point` looks again then); for None none. A ValueError where there is none
    to take, or where a fresh run (None) would share `output_dir` with an earlier run's checkpoints
    (`earlier_checkpoints_refusal`).
    `RESUME_IF_ANY` is True where `output_dir` holds a complete checkpoint (damaged ones too: they are named, not
    started over), else None."""
    if request == RESUME_IF_ANY:
        request = True if list_checkpoints(output_dir) else None
    if request is True:
        try:
            return str(newest_resumable_checkpoint(output_dir, warn))
        except ValueError:
            if before_lock and checkpoints_to_publish(output_dir):
                return None
            raise
    if request is None:
        if refused := earlier_checkpoints_refusal(output_dir):
            raise ValueError(refused)
        return None
    return request


def earlier_checkpoints_refusal(output_dir: str | os.PathLike) -> str | None:
    """The error for a fresh run (no resume) in an ``output_dir`` that holds an earlier run's checkpoints, else None:
    the two runs' checkpoints would be one list, which rotation and ``resume_from_checkpoint=True`` order by step."""
    found = list_checkpoints(output_dir)
    if not found:
        return None
    names = ", ".join(c.name for c in found[-3:])
    return (
        f"output_dir {output_dir} holds an earlier run's checkpoints ({'..., ' if len(found) > 3 else ''}{names}): a "
        "fresh run there would mix its own with them (save_total_limit would delete this run's first, and "
        "resume_from_checkpoint=True would take the earlier run's). Resume it (resume_from_checkpoint=True; "
        "--resume_from_checkpoint true), choose another output_dir, or delete those folders."
    )


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder's name (`checkpoint-<step>`) says it was written at."""
    return int(_CHECKPOINT_RE.match(Path(path).name).group(1))


def list_checkpoints(output_dir: str | os.PathLike, up_to: int | None = None) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first (a folder without its state file is incomplete);
    ``up_to``: those at or before that step (one past a run's step is of a run it went back on)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT_RE.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for step, path in sorted(found) if up_to is None or step <= up_to]


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, or None when every file a resume reads is there
    and reads: a missing file (`missing_files`), an empty one, a safetensors header that does not match the file's
    size (a full disk, a partial copy), a torch archive without its closing directory, JSON that does not parse, a
    `trainer_state.json` without its step. Headers only: cheap for any model size."""
    try:
        marker = read_marker(path)
    except (OSError, ValueError) as error:  # a truncated or damaged marker (a partial copy of output_dir)
        return f"{COMPLETE_MARKER}: {type(error).__name__}: {error}"
    if marker.get("model_only"):
        return (
            "it was saved with save_only_model=True: the policy and critic only, without the optimizer state, "
            "schedules and random state a resume needs (its weights start a new run: model=<its folder>)"
        )
    missing = missing_files(Path(path))
    if missing:
        return f"missing {', '.join(missing)}"
    return unreadable_file(Path(path))


def unreadable_file(path: Path) -> str | None:
    """The first file under the folder ``path`` that does not read (empty, a safetensors header that does not match
    its size, a torch archive without its closing directory, JSON that does not parse, a `trainer_state.json` without
    its step), named with why; None when all read. Headers only: cheap for any model size."""
    from safetensors import safe_open

    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        if file == Path(path) / "README.md":  # the Hub's model card, written after the checkpoint was published
            continue  # (a power loss can leave it empty): no resume reads it
        if file.parent == Path(path) and file.name in {f".{name}.tmp" for name in REWRITTEN_IN_PLACE}:
            continue  # a rewrite at an epoch's end cut before its rename (a power loss: empty); the file is whole
        try:
            if file.stat().st_size == 0:
                raise ValueError("empty file")
            if file.name == "trainer_state.json" and "global_step" not in json.loads(file.read_bytes()):
                raise ValueError("no global_step")
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt"):
                    pass
            elif file.suffix == ".pt" and _starts_with(file, b"PK") and not zipfile.is_zipfile(file):
                raise ValueError("not a complete torch archive")  # (legacy non-zip torch files are not checked)
            elif file.suffix == ".json":
                json.loads(file.read_bytes())
        except Exception as error:  # whatever a damaged file raises, it names this checkpoint unusable
            return f"{file.relative_to(path)}: {type(error).__name__}: {error}"
    return None


def missing_files(path: Path) -> list[str]:
    """The files a resume from ``path`` reads that are not there (what the checkpoint's marker says it holds)."""
    try:
        marker = read_marker(path)
    except (OSError, ValueError):
        marker = {}
    run = marker.get("run", {}) if isinstance(marker, dict) else {}
    run = run if isinstance(run, dict) else {}
    needed = ["trainer_state.json", "scheduler.pt"]
    # Each process's random state, and the value-pretraining window and the synced reference where they were written
    # (an older marker does not say): without them a resume warned and went on, the samples, the window or the KL's
    # reference not the saved run's, where an earlier whole checkpoint was at hand.
    training_state = marker.get("training_state", []) if isinstance(marker, dict) else []
    missing = [
        f"{TRAINING_STATE_DIR}/{name}"
        for name in training_state if isinstance(name, str) and not training_state_file(path, name).is_file()
    ]  # fmt: skip
    if run.get("deepspeed"):
        needed.append(DEEPSPEED_CHECKPOINT_TAG)
    else:
        needed.append("optimizer.pt")
        if "peft_policy" in run:  # (older markers do not say: either file)
            needed.append("adapter_model.safetensors" if run["peft_policy"] else "model.safetensors")
        critic = run.get("critic", "")
        if critic == "adapter on the policy's base":
            needed += [f"{CRITIC_SUBFOLDER}/adapter_model.safetensors", f"{CRITIC_SUBFOLDER}/{VALUE_HEAD_FILE}"]
        elif critic == "separate model":
            needed.append(f"{CRITIC_SUBFOLDER}/model.safetensors")
    for name in needed:
        if not (path / name).exists():
            shards = _missing_shards(path / name)
            missing += [name] if shards is None else [str(Path(name).with_name(shard)) for shard in shards]
    return missing


def _missing_shards(file: Path) -> list[str] | None:
    """``model.safetensors`` saved in shards (a large model): the files its index names that are not there (a partial
    copy); None where it is not sharded."""
    index = file.with_name("model.safetensors.index.json")
    if file.name != "model.safetensors" or not index.is_file():
        return None
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [index.name]  # (`unreadable_file` says why)
    return sorted(shard for shard in shards if not (file.parent / shard).is_file())


def _starts_with(file: Path, prefix: bytes) -> bool:
    with file.open("rb") as f:
        return f.read(len(prefix)) == prefix


def newest_resumable_checkpoint(output_dir: str | os.PathLike, warn: bool = True) -> Path:
    """The newest complete checkpoint in ``output_dir`` whose files all read; a warning (unless ``warn`` is False)
    names each damaged newer one passed over."""
    found = list_checkpoints(output_dir)
    if not found:
        raise ValueError(
            f"resume_from_checkpoint=True but no complete checkpoint in {output_dir}. (resume_from_checkpoint='auto' "
            "resumes where there is one and starts afresh where there is none.)"
        )
    problems = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if warn:
            logger.warning(f"Checkpoint {path} cannot be read ({problem}); resuming from an earlier one.")
        problems.append(f"{path.name}: {problem}")
    raise ValueError(
        f"resume_from_checkpoint=True but no checkpoint in {output_dir} can be read ({'; '.join(problems)})."
    )


def _resumable(checkpoint: Path) -> bool:
    """Whether a complete checkpoint holds what a resume reads (not `save_only_model`'s); an unreadable marker (a
    partial copy of `output_dir`) counts as not, rather than failing the save that rotates."""
    try:
        return not read_marker(checkpoint).get("model_only")
    except (ValueError, OSError):
        return False


def checkpoint_in(output_dir: str | os.PathLike, saved: str | os.PathLike) -> Path:
    """The checkpoint a path saved in the run's state (the best one's) names for a run writing to `output_dir`:
    `output_dir`'s own folder of that name where there is one, else the path as saved. A resumed run's `output_dir`
    may be a copy of the first run's (whose path the state still names: a best checkpoint there was kept in the
    original, deleted in the copy, and loaded from the original at the end), or spelt otherwise."""
    own = Path(output_dir) / Path(saved).name
    return own if own.is_dir() else Path(saved)


def rotate_checkpoints(
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    keep: Sequence[Path] = (),
    busy: Sequence[Path] = (),
    step: int | None = None,
) -> None:
    """Delete the oldest checkpoints beyond ``save_total_limit`` (never those in ``keep``: the newest, the best).
    Those in ``busy`` (a Hub upload still reads them) are left for a later rotation: over the limit until then.
    ``step``: the run's; a checkpoint past it is of a run this one went back on (resumed from an earlier
    checkpoint), and is rotated first. Kept by step number, it stayed while this run's own rotated away, and a
    requeued job (`resume_from_checkpoint=True`) resumed it. (transformers rotates by the folders' times: the
    checkpoints before the resume point, older, go first, and the abandoned one stays until they are gone.)

    ``keep`` is matched by the folder it names, not by its spelling: a run resumed with ``output_dir`` written
    otherwise (``./out``, an absolute path, a link, another working directory), or resumed from a copy of it, reads
    the best checkpoint's path, as the first run spelt it, from the saved state (`checkpoint_in`)."""
    if not save_total_limit or save_total_limit <= 0:
        return
    kept = {checkpoint_in(output_dir, p).resolve() for p in keep}
    found = list_checkpoints(output_dir)
    checkpoints = [c for c in found if c.resolve() not in kept]
    if step is not None:  # (a stable sort: the abandoned run's first, then this run's, oldest first)
        checkpoints.sort(key=lambda c: checkpoint_step(c) <= step)
    excess = len(found) - save_total_limit  # a kept path that is no checkpoint here (deleted, elsewhere) counts none
    reading = {Path(p).resolve() for p in busy}
    for stale in checkpoints[: max(excess, 0)]:
        if stale.resolve() not in reading:
            # Out of the checkpoints' names first, in one rename: a removal cut short (a kill, a file still open on
            # NFS) left a `checkpoint-N` without its marker, never listed again, so never removed; as debris, the
            # next run that holds the folder removes it (`remove_debris`).
            doomed = stale.with_name(f".{stale.name}.{run_owner()}.del")
            try:
                os.replace(stale, doomed)
            except OSError:
                doomed = stale
            shutil.rmtree(doomed, ignore_errors=True)


def apply_resumed_settings(optimizer, scheduler, asked: list[dict], schedules: list[dict]) -> None:
    """After a resume loaded the saved optimizer and schedules: the settings this run was given take effect from
    the next step (learning rates, weight decay, betas, the schedule's kind, warm-up and length), while where the
    schedules are (the step count, the actor's start at the end of value pretraining) stays the saved run's.
    ``asked``: the groups' hyperparameters and ``schedules``: the `Schedule` fields this run built, before loading."""
    from .optim import Schedule, rates_set

    for group, fresh in zip(optimizer.param_groups, asked):
        group.update({k: v for k, v in fresh.items() if k not in ("lr", "initial_lr")})
    lambdas = getattr(scheduler, "lr_lambdas", [])
    for schedule, fresh in zip(lambdas, schedules):
        if isinstance(schedule, Schedule):
            vars(schedule).update({k: v for k, v in fresh.items() if k != "start_step"})
    if lambdas and asked:
        scheduler.base_lrs = [fresh.get("initial_lr", fresh["lr"]) for fresh in asked]
        for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, lambdas):
            group["initial_lr"] = base
            group["lr"] = base * schedule(scheduler.last_epoch)
        rates_set(scheduler, optimizer)


def _accelerator_rng(started: bool):
    """(device type, its torch module) of the accelerator present here (CUDA, MPS, XPU, ...), whose generators
    sample on it; None on the CPU alone. ``started``: only once this process has started it (its generators exist;
    reading them would start it). Setting a state is lazy (CUDA's and XPU's apply once they start)."""
    device = torch.accelerator.current_accelerator(check_available=True)
    if device is None:
        return None
    module = torch.get_device_module(device.type)
    is_initialized = getattr(module, "is_initialized", None)  # MPS has none: it is started once available
    if started and is_initialized is not None and not is_initialized():
        return None
    return device.type, module


def training_state_file(checkpoint: Path, name: str) -> Path:
    """Where `checkpoint` holds the training-state file `name`: in its `TRAINING_STATE_DIR`, or at its root where a
    checkpoint written before that folder holds it (the folder's path where neither does)."""
    inside, root = checkpoint / TRAINING_STATE_DIR / name, checkpoint / name
    return root if root.is_file() and not inside.is_file() else inside


def save_rng_state(path: Path) -> None:
    """Python, NumPy and torch (the CPU's, and each device's of the accelerator in use) generator states, as
    safetensors with JSON metadata."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_keys.astype(np.int64))}
    accelerator = _accelerator_rng(started=True)
    if accelerator is not None:
        kind, module = accelerator
        for index in range(torch.accelerator.device_count()):
            tensors[f"torch_{kind}_{index}"] = module.get_rng_state(index)
    version, internal, gauss = random.getstate()
    metadata = {
        "python": json.dumps([version, list(internal), gauss]),
        "numpy": json.dumps([np_name, np_pos, np_has_gauss, np_gauss]),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_rng_state(path: Path) -> None:
    """Restore the states written by :func:`save_rng_state`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    version, internal, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(internal), gauss))
    np_name, np_pos, np_has_gauss, np_gauss = json.loads(metadata["numpy"])
    np.random.set_state((np_name, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    accelerator = _accelerator_rng(started=False)
    if accelerator is not None:
        kind, module = accelerator
        for key, state in tensors.items():  # `torch_<device type>_<index>`; another accelerator's states stay unread
            key_kind, _, index = key.removeprefix("torch_").rpartition("_")
            if key_kind == kind and int(index) < torch.accelerator.device_count():
                module.set_rng_state(state, int(index))


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a copy of each tensor whose storage an earlier one shares (tied embeddings): safetensors refuses
    shared storage. Only those are copied."""
    seen: set[int] = set()
    unshared = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return unshared


def run_fingerprint(
    actor_critic,
    args,
    num_processes: int,
    deepspeed: bool,
    train_prompts: int | None = None,
    base_weights: str | None = None,
    fsdp: bool = False,
) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the model (its architecture, and the base weights'
    digest `base_weights`, `modeling.policy_fingerprints`: the checkpoint's adapters or deltas were trained on
    them), the batch layout, the number of training prompts (None: a stream) and what orders them
    (`shuffle_dataset`, and the seed it shuffles with): the saved data position indexes that order. Whether
    DeepSpeed or FSDP ran: each saves its optimizer state in its own layout (FSDP's keyed by parameter name, one
    process's and DDP's by index, which FSDP's loader read as no state at all: Adam restarted, silently)."""
    config = actor_critic.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        config.pop(key, None)
    return {
        "model": get_config_model_id(actor_critic.config),
        "model_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "base_weights": base_weights,
        "critic": actor_critic.critic_description,
        "peft_policy": is_peft_model(actor_critic.policy),
        "policy_adapter": adapter_settings(actor_critic.policy),
        "num_processes": num_processes,
        "generation_batch_size": args.generation_batch_size,
        "num_generations": args.num_generations,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "num_iterations": args.num_iterations,
        "critic_num_iterations": args.critic_num_iterations,
        "value_pretrain_num_iterations": args.value_pretrain_num_iterations,
        "deepspeed": deepspeed,
        "fsdp": fsdp,
        "train_prompts": train_prompts,
        "data_order": data_order(args, streamed=train_prompts is None),
    }


def adapter_settings(policy) -> dict[str, Any] | None:
    """The policy adapter's config as a checkpoint records it (None without PEFT): a resume with another rank, other
    target modules or another scaling would load the saved adapter into other shapes, or silently into other
    modules, or train it at another scale."""
    if not is_peft_model(policy):
        return None
    config = policy.peft_config[POLICY_ADAPTER].to_dict()
    for key in ("base_model_name_or_path", "revision", "inference_mode", "peft_version"):  # not what trains
        config.pop(key, None)
    config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
    return json.loads(json.dumps(config, sort_keys=True, default=str))  # as the marker reads back


# `PromptCursor`'s epochs as permutations in turn of one generator; an older trl-vapo seeded epoch e by seed + e.
ONE_GENERATOR = ", each epoch the next permutation of one generator"


def data_order(args, streamed: bool = False) -> str:
    """What orders the training prompts (`PromptCursor`): a shuffle by `data_seed`, else `seed`, or none; for a stream,
    also the filter of `drop_long_prompts`, which drops its long prompts as they arrive: its saved position counts the
    rows let through (a data set's are counted before training: `train_prompts` differs)."""
    order = (
        f"shuffled with seed {args.seed if args.data_seed is None else args.data_seed} (data_seed, else seed)"
        if args.shuffle_dataset
        else "in the data set's order (shuffle_dataset=False)"
    )
    if args.shuffle_dataset and not streamed:
        order += ONE_GENERATOR
    if streamed and args.drop_long_prompts and args.max_prompt_length is not None:
        order += f", its prompts longer than {args.max_prompt_length} tokens dropped (drop_long_prompts)"
    return order


def prompts_digest(dataset) -> str | None:
    """SHA-256 of a data set's prompts in its order (None for a stream, or rows without a `prompt` column): a resume
    on prompts of the same number but another content (another file, another `--system_prompt` or template) reads
    the saved position in other prompts."""
    if not isinstance(dataset, Sized) or not hasattr(dataset, "select_columns"):
        return None
    if "prompt" not in (getattr(dataset, "column_names", None) or ()):
        return None
    digest = hashlib.sha256()
    for batch in dataset.select_columns(["prompt"]).iter(batch_size=1024):
        digest.update(json.dumps(batch["prompt"], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def changed_inputs(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """How a checkpoint's recorded inputs (`SavingMixin._run_inputs`: the prompts' digest, the reward functions and
    their weights) differ from this run's; a run may change them on purpose (a curriculum), so they are warned of,
    not refused. An older checkpoint records none."""
    if not saved:
        return []
    changes = []
    if None not in (saved.get("prompts_sha256"), current["prompts_sha256"]):
        if saved["prompts_sha256"] != current["prompts_sha256"]:
            changes.append(
                "its training prompts differ from this run's (another data set of the same size, another "
                "--system_prompt or prompt template): the saved position in the data is an index into its prompts"
            )
    for key, what in (("reward_funcs", "reward functions"), ("reward_weights", "reward weights")):
        if key in saved and saved[key] != current[key]:
            changes.append(f"its {what} were {saved[key]}, this run's are {current[key]}")
    return changes


def optimizer_kind(optimizer, zero_stage: int | None = None) -> str:
    """The optimizer that steps, as a checkpoint records it: the class that holds the state (the last of accelerate's
    and DeepSpeed's wrappers), and under DeepSpeed the ZeRO stage, which lays the state out: `AdamW (ZeRO stage 3)`.
    A resume with another (`optim` changed, or the stage) loaded the saved state into it: SGD found no momentum and
    restarted it silently, an 8-bit Adam or another stage failed deep in its library (`same_optimizer_state`)."""
    kind = type(stepping_optimizer(optimizer)).__qualname__
    return kind if zero_stage is None else f"{kind} (ZeRO stage {zero_stage})"


_SAME_STATE_AS = {"AdamW": "Adam", "DeepSpeedCPUAdam": "Adam", "FusedAdam": "Adam", "DeepSpeedCPUAdagrad": "Adagrad"}
"""Optimizers whose state is another's: Adam's moments under AdamW, and DeepSpeed's CPU Adam (accelerate's stand-in
for AdamW where the optimizer is offloaded: offload turned on or off at a resume) and fused one."""


def same_optimizer_state(saved: str, current: str) -> bool:
    """Whether a checkpoint's optimizer (`optimizer_kind`) holds the state this run's reads: the same class, or one
    `_SAME_STATE_AS` names alike, at the same ZeRO stage."""

    def family(kind: str) -> tuple[str, str]:
        name, _, stage = kind.partition(" ")
        return _SAME_STATE_AS.get(name, name), stage

    return family(saved) == family(current)


def optimizer_state_problem(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """Why a saved optimizer state cannot be this optimizer's, or None: its parameter groups hold other numbers of
    tensors, where torch says only that a group "doesn't match the size" (a checkpoint of an older trl-vapo whose
    critic adapter also adapted an LM head named in `target_modules`, or a change of trainable modules that the
    fingerprint does not record)."""
    saved = [len(group["params"]) for group in state["param_groups"]]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved == current:
        return None
    return (
        f"its optimizer state holds {saved} tensors in its parameter groups, and this run trains {current}: the "
        "checkpoint's run trained other parameters (other trainable modules or adapters, or an older trl-vapo's "
        "critic adapter, which also adapted an LM head named in target_modules). Resume with the settings and the "
        "trl-vapo version that wrote it, or start a new run"
    )


def check_resumable(
    path: Path, saved: dict[str, Any], current: dict[str, Any], position: dict[str, Any] | None = None
) -> None:
    """Refuse to resume, naming every difference, from a checkpoint another kind of run wrote (`position`: its
    `TrainingProgress`, as saved)."""
    # Older checkpoints predate these keys; their critic and value-pretraining passes were both `num_iterations`, and
    # their data set went unrecorded.
    defaults = {key: saved.get("num_iterations") for key in ("critic_num_iterations", "value_pretrain_num_iterations")}
    unrecorded = {
        key: current.get(key) for key in ("train_prompts", "data_order", "policy_adapter", "base_weights", "fsdp")
    }
    saved = {"deepspeed": False, **unrecorded, **defaults, **saved}
    order = current.get("data_order") or ""
    if order.endswith(ONE_GENERATOR) and saved["data_order"] == order.removesuffix(ONE_GENERATOR):
        # An older trl-vapo's: its epoch 0 is this version's, a later epoch's order was seeded by seed + epoch. From
        # an epoch's start this run goes on in its own order; partway through one, it would read other prompts.
        epoch, index = ((position or {}).get(key, 0) for key in ("data_epoch", "data_index"))
        if epoch >= 1 and index > 0:
            raise ValueError(
                f"Cannot resume from {path}: it is {index} prompts into epoch {epoch}, whose order the trl-vapo that "
                "wrote it drew by seed + epoch, where this version draws each epoch's in turn from one generator (the "
                "prompts this run would read next are not the rest of that epoch's). Resume with the trl-vapo version "
                "that wrote it, or from a checkpoint of its first epoch, or start a new run."
            )
        saved["data_order"] = order
    differences = [_difference(key, saved.get(key), current[key]) for key in current if key != "model"]
    differences = [difference for difference in differences if difference]
    if differences:
        raise ValueError(
            f"Cannot resume from {path}: it was written by a different run (model {saved.get('model')!r}). "
            + "; ".join(differences)
            + ". Resume with the same model, PEFT settings, process count, batch sizes, training data and data order "
            "(the saved position in the data is an index into its order) and launcher (DeepSpeed, FSDP or neither), "
            "or start a new run."
        )


def _difference(key: str, saved: Any, current: Any) -> str | None:
    """How a checkpoint's fingerprint entry differs from this run's (None: alike). Of two settings dicts, the keys
    that differ among those both have (a newer library's new field is no difference)."""
    if key == "base_weights" and saved != current:  # two digests: say what differs, not their hex
        return (
            "base_weights: the model's weights are not those the checkpoint's run started from (another checkpoint "
            "of the same architecture, or one stored in float32 and loaded in another dtype)"
        )
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = sorted(k for k in saved.keys() & current.keys() if saved[k] != current[k])
        if not keys:
            return None
        return f"{key}: " + ", ".join(f"{k} checkpoint {saved[k]!r}, this run {current[k]!r}" for k in keys)
    return None if saved == current else f"{key}: checkpoint {saved!r}, this run {current!r}"


class SavingMixin:
    """The methods of `VAPOTrainer` that write and read its outputs (policy, critic, model card, checkpoints)."""

    _run_owner: str | None = None  # `train` sets the main process's on every process; else this process's own
    _resume_point: tuple | None = None  # (request, `resume_point`'s answer) until `train` takes it
    run_record: RunRecord  # what the trainer knows of the run, for the card and the pretrained critic's record

    def checkpoint_to_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint `train(resume_from_checkpoint=...)` names (`resume_request`): a path as given; True the
        newest one that reads, chosen by the main process so that every process resumes the same step whatever it
        sees on disk; None none, refused where `output_dir` holds an earlier run's checkpoints
        (`earlier_checkpoints_refusal`)."""
        resume_from_checkpoint = resume_request(resume_from_checkpoint)
        if resume_from_checkpoint not in (True, None, RESUME_IF_ANY):  # a path
            return resume_from_checkpoint
        before_lock = not getattr(self, "_holding_output_dir", False)
        resolve = functools.partial(
            resolve_resume, self.args.output_dir, resume_from_checkpoint, before_lock=before_lock
        )
        return decided_on_main(resolve, self.accelerator)

    def _save_pretrained_critic(self) -> None:
        """Save the critic where `value_model=<output_dir>/value_pretrained_critic` finds it in a later run."""
        directory = Path(self.args.output_dir) / PRETRAINED_CRITIC_DIR
        tmp = temporary_folder(directory, self._run_owner or run_owner())
        self.accelerator.wait_for_everyone()
        with self._full_weights() as state_dict:
            if self.accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                # In its training weights, not as loaded: a later run goes on training it (float32; under DeepSpeed
                # with bf16, DeepSpeed's bf16 copies: its float32 masters are its optimizer's, not saved here).
                self.accelerator.unwrap_model(self.model_wrapped).save_critic(tmp, state_dict)
        if self.accelerator.is_main_process:
            record = {
                "rollouts": self.progress.value_pretrain_rollouts,
                "budget": self.args.value_pretrain_steps,  # the rollouts it could have run (its stop rule may end it)
                "final_explained_variance": self.progress.final_explained_variance(self.args.value_pretrain_patience),
                "final_readings": self.progress.final_readings(self.args.value_pretrain_patience),
                "final_statistic": "median",  # (a record of before 2026-12-01 holds their mean)
                "explained_variances": self.progress.explained_variances,
                "policy": self.run_record.base_model,
                "policy_fingerprint": self.run_record.policy_fingerprint,
                "value_targets": self.run_record.value_targets,
            }
            (tmp / VALUE_PRETRAINING_FILE).write_text(strict_json(record, indent=2))
            publish(tmp, directory)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (`AutoModelForCausalLM.from_pretrained(output_dir)`, or a PEFT adapter) with the
        tokenizer, the critic in `output_dir/critic`, and a model card. Into the run's `output_dir`, while holding it
        (`holding_output_dir`): after `train()` returned (TRL's `trainer.train(); trainer.save_model()`), a run started
        there meanwhile took it as free and removed the save being written as a stopped run's debris.

        Where every process holds the whole weights (DDP, one process) the main process saves alone, with no
        collective, and the others return at once, as transformers' `save_model`: a script may call it on the main
        process only (`if trainer.accelerator.is_main_process: trainer.save_model()`), where it waited in a
        collective for the others, forever, or failed unsaved where they had ended ("Connection closed by peer").
        Under DeepSpeed and FSDP every process calls it: the weights are gathered from their shards."""
        output_dir = Path(output_dir or self.args.output_dir)
        own = output_dir.resolve() == Path(self.args.output_dir).resolve()
        alone = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        if not alone or self.accelerator.is_main_process:
            with self.holding_output_dir(alone) if own else contextlib.nullcontext(), stop_signals_held():
                self._save_model(output_dir, alone)
        if self.args.push_to_hub and not _internal_call:  # as transformers: a user's save is pushed
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_model(self, output_dir: Path, alone: bool) -> None:
        with self._full_weights() as state_dict:
            if self.accelerator.is_main_process:
                # Written aside, then moved in: a full disk leaves `output_dir` as it was, not a policy without
                # its critic or tokenizer (the moves need no space). `output_dir` may hold the run's checkpoints:
                # the files are moved one by one, not the folder. Aside means inside a folder that exists (it may be
                # a mount point, whose parent is another file system: no rename across), beside one that does not
                # (resolved: "." has no name to put beside it).
                owner = f"save_model.{run_owner()}"
                if output_dir.is_dir():
                    tmp = output_dir / f".{owner}.tmp"
                else:
                    tmp = temporary_folder(output_dir.resolve(), owner)
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    self._write_models(tmp, state_dict, as_loaded=True)
                    fsync_tree(tmp)
                    output_dir.mkdir(parents=True, exist_ok=True)
                    written = {item.name for item in tmp.iterdir()}
                    for item in sorted(tmp.iterdir()):
                        if item.is_dir() and (output_dir / item.name).is_dir():
                            shutil.rmtree(output_dir / item.name)  # an earlier save's critic/
                        os.replace(item, output_dir / item.name)
                    # An earlier save's files that this one did not write would load instead, or be pushed with it:
                    # its adapter; its full weights in another sharding, where this save wrote full weights
                    # (`from_pretrained` prefers a `model.safetensors` to the shards beside it; an adapter saved over
                    # full weights leaves them: the folder may hold the base model); its critic, where this run has
                    # none (a frozen value function); an earlier `trl-vapo train`'s data flags, which eval would read
                    # as this model's (a save from Python writes none).
                    stale = (
                        [output_dir / name for name in ADAPTER_FILES] if "adapter_config.json" not in written else []
                    )
                    stale += [output_dir / RUN_DATA_FILE] if RUN_DATA_FILE not in written else []
                    if any(fnmatch.fnmatch(name, pattern) for name in written for pattern in WEIGHT_FILES):
                        stale += [
                            p for pattern in WEIGHT_FILES for p in output_dir.glob(pattern) if p.name not in written
                        ]
                    for path in stale:
                        path.unlink(missing_ok=True)
                    if CRITIC_SUBFOLDER not in written:
                        shutil.rmtree(output_dir / CRITIC_SUBFOLDER, ignore_errors=True)
                    _fsync_dir(output_dir)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                self.create_model_card(output_dir=output_dir)  # it names output_dir's paths: written in place
        if not alone:
            self.accelerator.wait_for_everyone()

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """transformers' `Trainer.push_to_hub` (5.x: the model saved, its card written, `output_dir` uploaded; its
        steps copied, the ignore patterns extended), leaving out this trainer's own files there as well: transformers
        skips only `_*` and `checkpoint-*`, and while a run holds `output_dir` (`trl-vapo train` saves and pushes
        inside `holding_output_dir`) it holds the run's lock (`.vapo_run.lock`: PID, host, start time), and maybe a
        stopped run's half-written `.<name>.<run>.tmp`. (Renaming those `_...` would change the lock's on-disk name,
        which runs of earlier versions look for.)"""
        from transformers.trainer import hf_api

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None and self.args.should_save:
            model_name = (self.args.hub_model_id or Path(self.args.output_dir).name).split("/")[-1]
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        model_tags = getattr(self.model, "model_tags", None) or []
        if model_tags:  # the model's own tags with the caller's, as transformers adds them
            tags = kwargs.get("tags") or []
            tags = [tags] if isinstance(tags, str) else list(tags)
            kwargs["tags"] = tags + [tag for tag in model_tags if tag not in tags]
        # The card names the branch it goes to (`revision`, else `hub_revision`): its quick start loads that one.
        self.create_model_card(model_name=model_name, hub_revision=revision, **kwargs)
        self._finish_current_push()
        # This run's value-pretrained critic goes up beside the model (`owner/name/value_pretrained_critic` skips the
        # phase in a new run, as the card says); an earlier run's in the folder, which the card does not name, stays
        # here, and one an earlier push left in the repository goes (with this run's, the files it does not hold).
        pretrained_critic = [] if self._pretrained_critic_of_this_run() else [f"{PRETRAINED_CRITIC_DIR}/*"]
        return hf_api().upload_folder(
            repo_id=self.hub_model_id,
            folder_path=self.args.output_dir,
            commit_message=commit_message,
            token=token,
            run_as_future=not blocking,
            ignore_patterns=["_*", f"{CHECKPOINT_PREFIX}-*", ".*", *pretrained_critic],
            delete_patterns=[*HUB_WEIGHT_FILES, f"{PRETRAINED_CRITIC_DIR}/*"],
            revision=revision if revision is not None else self.args.hub_revision,
        )

    @contextlib.contextmanager
    def _full_weights(self):
        """Under ZeRO-3 and FSDP2 each rank holds a shard of every weight: gather them for saving (a collective:
        every rank enters, the main process writes). Yields the gathered state dict on the main process, else None
        (the parameters themselves are whole, or another process writes)."""
        unsaved = self.actor_critic.weights_not_saved()  # (not gathered: a LoRA policy's frozen base)
        yield gathered_state_dict(self.model_wrapped, self.accelerator, skip=unsaved)

    def _write_models(
        self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None, as_loaded: bool = False
    ) -> None:
        """Policy, critic, tokenizer and config; ``as_loaded``: the models in the dtype they were loaded in (what
        `save_model` gives the user), else their training weights (a checkpoint, to resume exactly: float32; under
        DeepSpeed with bf16, DeepSpeed's bf16 copies, its float32 masters in its own state)."""
        directory.mkdir(parents=True, exist_ok=True)
        model = (
            self.accelerator.unwrap_model(self.model_wrapped) if self.model_wrapped is not None else self.actor_critic
        )
        model.save_policy(directory, state_dict, as_loaded)
        model.save_critic(directory / CRITIC_SUBFOLDER, state_dict, as_loaded)
        self.processing_class.save_pretrained(directory)
        (directory / RUN_CONFIG_FILE).write_text(self.args.to_json_string())
        if self.run_script_args is not None:  # with the model it describes: a run in the folder of an earlier one
            # wrote it at its start, and eval read the new run's data with the old run's model until the new one saved
            (directory / RUN_DATA_FILE).write_text(json.dumps(self.run_script_args, indent=2) + "\n")

    def _pretrained_critic_of_this_run(self) -> Path | None:
        """`<output_dir>/value_pretrained_critic` where this run's value pretraining (or that of the run it resumed)
        wrote it, else None. Value pretraining writes its critic and record as it ends: until then, or where it did
        not run, a folder there is an earlier run's (a fresh run in a folder without checkpoints): not this run's to
        report or push."""
        folder = Path(self.args.output_dir) / PRETRAINED_CRITIC_DIR
        ran = self.progress.value_pretrain_rollouts > 0 and self.progress.phase != VALUE_PRETRAIN
        return folder if ran and folder.is_dir() else None

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        *,
        output_dir: str | Path | None = None,
        **kwargs,
    ) -> None:
        """Write `README.md` in `output_dir` (default `args.output_dir`): base model, data, the VAPO settings, value
        pretraining, the critic and where it is, held-out scores when `model_card_info["held_out"]` has them, training
        metrics (`trl_vapo.model_card`). The arguments before `output_dir` are TRL's, in its order."""
        if not self.is_world_process_zero():
            return
        output_dir = Path(output_dir or self.args.output_dir)
        info = {**self.model_card_info, **kwargs}
        run = self.run_record
        pretrained_dir = self._pretrained_critic_of_this_run()
        if run.critic_pretrained:
            value_pretraining = {"skipped": "the critic (`value_model`) came from an earlier value pretraining"}
        elif run.value_function is not None:
            value_pretraining = {"skipped": "the values came from a frozen value function (`value_model`)"}
        elif self.progress.value_pretrain_rollouts > 0:  # this run's (or the run it resumed): not an earlier run's
            patience = self.args.value_pretrain_patience
            value_pretraining = (
                value_pretraining_record(pretrained_dir)
                if pretrained_dir is not None
                else {  # under way: what it ran so far, its readings' median as its stop rule reads them
                    "rollouts": self.progress.value_pretrain_rollouts,
                    "final_explained_variance": self.progress.final_explained_variance(patience),
                    "final_readings": self.progress.final_readings(patience),
                    "final_statistic": "median",
                }
            )
        else:
            value_pretraining = None
        urls = tracker_urls()
        card = build_model_card(
            base_model=run.base_model,
            output_dir=output_dir,
            args=self.args,
            model_name=model_name,
            hub_model_id=self.hub_model_id,
            dataset_name=dataset_name or info.get("dataset_name"),
            dataset_config=info.get("dataset_config"),
            dataset_description=info.get("dataset_description"),
            is_adapter=run.is_adapter,
            adapter_type=run.adapter_type,
            critic_shares_base=run.critic_shares_base,
            critic_auto_class=run.critic_auto_class,
            critic_source=run.critic_source,
            value_function=run.value_function,
            value_pretraining=value_pretraining,
            pretrained_critic_dir=pretrained_dir if value_pretraining else None,
            held_out=info.get("held_out"),
            log_history=self.state.log_history,
            example_prompt=run.example_prompt,
            tags=[tags] if isinstance(tags, str) else list(tags or []),  # one tag, as transformers takes it
            license=info.get("license"),
            wandb_url=urls["wandb"],
            trackio_url=urls["trackio"],
            citation=VAPO_CITATION,
            hub_revision=info.get("hub_revision"),
        )
        card.save(str(output_dir / "README.md"))

    def _save_checkpoint(self, model=None, trial=None, model_only: bool | None = None) -> None:
        """Write `checkpoint-<step>` completely (policy, critic, optimizer, scheduler, RNG, state), then rename it
        into place: a crash mid-write leaves the previous checkpoint intact. `model_only` (default:
        `save_only_model`): without the optimizer, the schedules and the random state, which only a resume reads."""
        model_only = self.args.save_only_model if model_only is None else model_only
        final = Path(self.args.output_dir) / f"{CHECKPOINT_PREFIX}-{self.state.global_step}"
        tmp = temporary_folder(final, self._run_owner or run_owner())
        with write_errors_named(final, tmp):
            self._write_checkpoint(final, tmp, model_only)
        self._checkpoint_step = None if model_only else self.state.global_step  # (a resumable one's step)
        if self.accelerator.is_main_process and not getattr(self, "_room_checked", False):
            self._room_checked = True  # once, on the run's first checkpoint: the later ones are as large
            if problem := room_for_checkpoints(final, self.args, self.state.global_step, self.state.max_steps):
                logger.warning(problem)
        if self.args.push_to_hub:
            self._push_from_checkpoint(str(final))
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _record_epoch_end(self) -> None:
        """The epoch end after the loop ran at the step of this run's last checkpoint, written before it (a save
        strategy's, at the last step): its record says so, or a resume from it would run that epoch end again
        (`TrainingProgress.epoch_ended_step`: a run a stop signal ended before it runs it)."""
        if self._checkpoint_step != self.state.global_step:
            return
        folder = Path(self.args.output_dir) / f"{CHECKPOINT_PREFIX}-{self.state.global_step}"
        if self.state.best_global_step == self.state.global_step:  # the epoch end's evaluation: the weights saved
            self.state.best_model_checkpoint = str(folder)  # (on every process, as transformers sets it)
        if not self.accelerator.is_main_process:
            return
        marker = read_marker(folder)
        if marker["progress"].get("epoch_ended_step") == self.state.global_step:
            return
        marker["progress"]["epoch_ended_step"] = self.state.global_step
        write_marker(folder, marker)
        # Then its trainer state, where the epoch end logged or evaluated: its log, the best metric and the early
        # stopping count (a resume read them as before it, and ran it no more). In this order, a stop between the
        # two leaves that state, not the epoch end run again on resume (its evaluation logged twice, counted twice
        # by early stopping).
        saved = json.loads((folder / "trainer_state.json").read_text())
        now = dataclasses.asdict(self.state)
        moved = [
            key
            for key in ("log_history", "best_metric", "best_model_checkpoint")
            if _json(saved.get(key)) != _json(now[key])
        ]
        if moved:
            write_whole(folder, "trainer_state.json", self._write_trainer_state)
        _fsync_dir(folder)
        if moved and self.args.push_to_hub:  # its upload, queued as it was written, holds the state before them
            self._push_from_checkpoint(str(folder), always=True)

    def _write_trainer_state(self, path: Path) -> None:
        """`state` as transformers saves it in a checkpoint, with the callbacks' states: by class, a list where a
        class has several instances (two early stopping callbacks), each restored to its own on resume
        (`_load_callback_state`)."""
        callbacks = self.callback_handler.callbacks + [self.control]
        stateful = [cb for cb in callbacks if isinstance(cb, ExportableState)]
        self.state.stateful_callbacks = TrainerState(stateful_callbacks=stateful).stateful_callbacks
        self.state.save_to_json(str(path))

    def _rotate_checkpoints(self, newest: Path) -> None:
        """`save_total_limit`'s rotation, keeping `newest` and the best checkpoint, and the checkpoints a Hub upload
        still reads (for a later rotation: waiting for the upload here would stall training, and the processes
        waiting at the next collective could time out)."""
        best = self.state.best_model_checkpoint
        keep = [newest] + ([Path(best)] if best and Path(best) != newest else [])
        if self.args.save_only_model and self.args.save_total_limit:
            # The newest checkpoint a resume can read (the one a SIGTERM forced, or the run's own before the setting
            # changed): the model-only ones after it would otherwise rotate away the only way to resume.
            ours = list_checkpoints(self.args.output_dir, up_to=self.state.global_step)
            resumable = next((c for c in reversed(ours) if _resumable(c)), None)
            if resumable is not None:
                keep.append(resumable)
        pushing = getattr(self, "push_in_progress", None)  # transformers' record of the uploads under way
        reading = getattr(self, "_uploads_read", []) if pushing is not None and not pushing.is_done() else []
        rotate_checkpoints(
            self.args.output_dir, self.args.save_total_limit, keep=keep, busy=reading, step=self.state.global_step
        )

    def _push_from_checkpoint(self, checkpoint_folder: str, always: bool = False) -> None:
        """`push_to_hub=True` while training, as transformers pushes (by `hub_strategy`; one upload at a time unless
        `hub_always_push` or `always`: queued behind the running one; in the background), from this trainer's
        checkpoint: its policy, critic and tokenizer to the repository's root, and with `checkpoint` /
        `all_checkpoints` the whole checkpoint (what a resume reads) to `last-checkpoint/` or a folder of its name.
        transformers copies the policy's files into `output_dir` and uploads that folder, which here holds no critic
        and may hold the next checkpoint, half-written."""
        from transformers.trainer import PushInProgress, hf_api
        from transformers.trainer_utils import HubStrategy

        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        running = self.push_in_progress is not None and not self.push_in_progress.is_done()
        if running and not (always or self.args.hub_always_push):
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        # The model card with it, as GRPOTrainer writes one at each checkpoint: a run that stops before
        # `save_model` leaves a repository whose model says what it is (and the trackers' pages while they run).
        self.create_model_card(output_dir=checkpoint_folder)
        message = f"Training in progress, step {self.state.global_step}"
        hub = dict(
            repo_id=self.hub_model_id, token=self.args.hub_token, revision=self.args.hub_revision, run_as_future=True
        )
        jobs = [
            hf_api().upload_folder(
                folder_path=checkpoint_folder,
                commit_message=message,
                ignore_patterns=[*TRAINING_STATE, ".*"],
                delete_patterns=HUB_WEIGHT_FILES,
                **hub,
            )
        ]
        if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            name = (
                "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
            )
            jobs.append(
                hf_api().upload_folder(
                    folder_path=checkpoint_folder,
                    path_in_repo=name,
                    commit_message=f"{message}, checkpoint",
                    # (a rewrite at an epoch's end under way, `.<name>.tmp` (`write_whole`), is left out)
                    ignore_patterns=[".*"],
                    **hub,
                )
            )
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress, self._uploads_read = PushInProgress(jobs), [Path(checkpoint_folder)]
        else:
            self.push_in_progress.jobs.extend(jobs)
            self._uploads_read.append(Path(checkpoint_folder))

    def _write_checkpoint(self, final: Path, tmp: Path, model_only: bool = False) -> None:
        main = self.accelerator.is_main_process
        state = tmp / TRAINING_STATE_DIR
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if not model_only:
                state.mkdir()
        self.accelerator.wait_for_everyone()
        written = []  # the training state's files, which the marker lists (`missing_files`): every process's
        if not model_only:
            save_rng_state(state / RNG_FILE.format(self.accelerator.process_index))
            written += [RNG_FILE.format(i) for i in range(self.accelerator.num_processes)]
            if self.progress.phase == VALUE_PRETRAIN and self._replay and self.args.value_pretrain_replay > 0:
                written += [REPLAY_FILE.format(i) for i in range(self.accelerator.num_processes)]
                # the rollouts the next one's window keeps
                window = self._replay[-self.args.value_pretrain_replay :]
                save_rollouts(window, str(state / REPLAY_FILE.format(self.accelerator.process_index)))
        with self._full_weights() as state_dict:
            if main:
                self._write_models(tmp, state_dict)
        if self._reference_moves() and not model_only:
            reference = placed_state_dict(self.ref_model, self.accelerator)  # a collective
            if main:
                save_file(_unshared(reference), str(state / REFERENCE_FILE))
            written.append(REFERENCE_FILE)
        if self.is_deepspeed_enabled and not model_only:
            # ZeRO partitions the optimizer state over the ranks: each writes its own part.
            self.model_wrapped.save_checkpoint(str(tmp), tag=DEEPSPEED_CHECKPOINT_TAG, exclude_frozen_parameters=True)
        elif not model_only:
            optimizer_state = (  # FSDP2's is sharded as the weights are: gathered whole (a collective)
                fsdp2_optimizer_state(self.model_wrapped, self.optimizer)
                if self.is_fsdp_enabled
                else self.optimizer.state_dict()
            )
        if main and not model_only:
            if not self.is_deepspeed_enabled:
                torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(self.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            if self.accelerator.scaler is not None:  # fp16's loss scale, where it has come to
                torch.save(self.accelerator.scaler.state_dict(), tmp / SCALER_FILE)
        if self.state.best_global_step == self.state.global_step:  # `metric_for_best_model`'s best so far
            self.state.best_model_checkpoint = str(final)  # on every process, as transformers sets it
        if main:
            self._write_trainer_state(tmp / "trainer_state.json")
        self.accelerator.wait_for_everyone()
        if main:
            # Written last: its presence marks the folder complete.
            marker = {
                "progress": dataclasses.asdict(self.progress),
                "run": self._fingerprint(),
                "inputs": self._run_inputs(),
                "optimizer": optimizer_kind(self.optimizer, self._zero_stage()),
                "training_state": written,
            }
            if model_only:
                marker["model_only"] = True  # `checkpoint_problem`: not one to resume from
            write_marker(tmp, marker)
            publish(tmp, final)
            self._rotate_checkpoints(final)
        self.accelerator.wait_for_everyone()

    def _restore_random_state(self) -> None:
        """The random state of the checkpoint resumed from, where its loop begins: after `on_train_begin` (a
        tracker's setup, a user's callback) and `eval_on_start`, whose draws the run it resumes made before its
        first step, not at this point. Loaded before them, they shifted every draw after (the samples, the
        shuffles) from the uninterrupted run's, as transformers' Trainer avoids by loading it in its loop."""
        if getattr(self, "_rng_state_file", None) is not None:
            load_rng_state(self._rng_state_file)
            self._rng_state_file = None

    def _reference_moves(self) -> bool:
        """Whether the KL penalty's reference is a model that `sync_ref_model` mixes the policy into: a checkpoint
        holds it, as it holds the policy."""
        return self.ref_model is not None and self.args.sync_ref_model

    def _zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage (None without DeepSpeed)."""
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None

    def _fingerprint(self) -> dict[str, Any]:
        prompts = len(self.train_dataset) if isinstance(self.train_dataset, Sized) else None  # a stream: None
        args = (self.actor_critic, self.args, self.accelerator.num_processes, self.is_deepspeed_enabled)
        base_weights = self.run_record.base_fingerprint
        return run_fingerprint(*args, train_prompts=prompts, base_weights=base_weights, fsdp=self.is_fsdp_enabled)

    def _run_inputs(self) -> dict[str, Any]:
        """What a checkpoint records of the run's inputs beyond its fingerprint (`changed_inputs` warns of a change
        on resume): the prompts' digest, taken once per data set, and the reward functions and their weights."""
        dataset = self.train_dataset
        if getattr(self, "_prompts_digest", (None, None))[0] is not dataset:
            self._prompts_digest = (dataset, prompts_digest(dataset))
        return {
            "prompts_sha256": self._prompts_digest[1],
            "reward_funcs": list(self.reward_func_names),
            "reward_weights": self.scorer.weights.tolist(),
        }

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> tuple[str | None, dict[str, Any] | None]:
        """The checkpoint `train(resume_from_checkpoint=...)` resumes from (`checkpoint_to_resume`) and its marker,
        once it is known to be one this run can resume from; (None, None) for a fresh run. A clear ValueError
        otherwise: the command line calls it before training, to say it in one line."""
        request = resume_request(resume_from_checkpoint)
        if self._resume_point is not None and self._resume_point[0] == request:  # asked before `train` (the CLI):
            return self._resume_point[1]  # its warnings said once
        path = self.checkpoint_to_resume(request)
        point = (None, None) if path is None else (path, self._checked_marker(Path(path)))
        if request is not True or path is not None:  # (True without a path: one to publish first; `train` looks again)
            self._resume_point = (request, point)
        return point

    def _checked_marker(self, path: Path) -> dict[str, Any]:
        """The marker of the checkpoint `path`, once it is known to be one this run can resume from."""
        problem = checkpoint_problem(path) if (path / COMPLETE_MARKER).is_file() else None
        if problem is not None:
            earlier = [c.name for c in list_checkpoints(path.parent) if c != path]
            raise ValueError(
                f"Cannot resume from {path}: {problem}. Resume from an earlier checkpoint ({earlier}), or pass "
                "resume_from_checkpoint=True to take the newest one that reads."
            )
        marker = read_marker(path)
        check_resumable(path, marker["run"], self._fingerprint(), marker.get("progress"))
        changes = changed_inputs(marker.get("inputs"), self._run_inputs()) if self.accelerator.is_main_process else []
        if changes:
            logger.warning(f"Resuming from {path.name}, whose run had other inputs: " + "; ".join(changes) + ".")
        # The newer ones where this run writes (a resume from a copy elsewhere too), those that read (True skips
        # the others): e.g. going back before a divergence.
        output_dir, resumed = Path(self.args.output_dir), _CHECKPOINT_RE.match(path.name)
        newer = [
            c.name
            for c in list_checkpoints(output_dir)
            if resumed and checkpoint_step(c) > int(resumed[1]) and checkpoint_problem(c) is None
        ]
        if newer and self.accelerator.is_main_process:
            logger.warning(
                f"Resuming from {path.name} while {output_dir} holds newer checkpoints of another course: "
                f"{', '.join(newer)}. This run writes over each as it reaches its step, and save_total_limit's "
                f"rotation removes them first; until then resume_from_checkpoint=True would take {newer[-1]}: move "
                "them aside to keep them (and for True to take this run's)."
            )
        return marker

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`, as transformers' Trainer ends a run: the best checkpoint's policy and critic (on
        every process: each has its copy; VAPOConfig refuses the option where the weights are sharded)."""
        best = checkpoint_in(self.args.output_dir, self.state.best_model_checkpoint)
        if not (best / COMPLETE_MARKER).is_file():  # moved, deleted: as transformers, the run keeps its last weights
            logger.warning(
                f"The best checkpoint {self.state.best_model_checkpoint} is gone: the run ends with the weights it "
                "trained last, not the best ones (load_best_model_at_end)."
            )
            return
        logger.info(
            f"Loading the best checkpoint {best} ({self.args.metric_for_best_model}: {self.state.best_metric})."
        )
        self._load_weights(best)
        self.generation_engine.weights_changed()  # vLLM holds the last step's weights: pushed again at its next use

    def _load_weights(self, path: Path) -> None:
        """The policy's and the critic's weights of the checkpoint `path`, into `actor_critic` as it is."""
        self.actor_critic.load_policy(path)
        self.actor_critic.load_critic(path / CRITIC_SUBFOLDER)

    def _load_checkpoint(self, path: Path, marker: dict[str, Any]) -> None:
        """Resume from `path` (`_checked_marker` read `marker`) once the models and the optimizer are placed."""
        # What this run's config asks of the optimizer and the schedules: the loaded state would restore the saved
        # run's (its learning rates, weight decay, schedule), and the new checkpoints' config would not be what ran.
        asked = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        saved_kind, kind = marker.get("optimizer"), optimizer_kind(self.optimizer, self._zero_stage())
        if saved_kind is not None and not same_optimizer_state(saved_kind, kind):  # (an older checkpoint's: None)
            raise ValueError(
                f"Cannot resume from {path}: its run's optimizer was {saved_kind}, this run's is {kind} (`optim`, the "
                "optimizer given, or DeepSpeed's ZeRO stage): the saved state is the other's. Resume with the "
                "optimizer that wrote it, or start a new run."
            )
        schedules = [dict(vars(s)) for s in getattr(self.lr_scheduler, "lr_lambdas", [])]
        if self.is_deepspeed_enabled:
            loaded, _ = self.model_wrapped.load_checkpoint(
                str(path), tag=DEEPSPEED_CHECKPOINT_TAG, load_module_strict=False, load_lr_scheduler_states=False
            )
            if loaded is None:
                raise ValueError(
                    f"{path} holds no DeepSpeed state ({DEEPSPEED_CHECKPOINT_TAG}/): not a DeepSpeed run's."
                )
        elif self.is_fsdp_enabled:  # the weights were loaded before FSDP2 sharded them (`_train`)
            load_fsdp2_optimizer_state(self.model_wrapped, self.optimizer, path / "optimizer.pt")
        else:
            self._load_weights(path)
            # Loaded on the CPU; `load_state_dict` moves each state to its parameter's device.
            optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
            if problem := optimizer_state_problem(optimizer_state, self.optimizer):
                raise ValueError(f"Cannot resume from {path}: {problem}")
            self.optimizer.load_state_dict(optimizer_state)
            if self.accelerator.scaler is not None and (path / SCALER_FILE).is_file():  # else fp16 starts its scale
                self.accelerator.scaler.load_state_dict(torch.load(path / SCALER_FILE, weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        apply_resumed_settings(self.optimizer, self.lr_scheduler, asked, schedules)
        stateful = self.state.stateful_callbacks
        self.state = TrainerState.load_from_json(str(path / "trainer_state.json"))
        # The saved state is the main process's: each process takes back its own rank (else every rank logs, draws
        # progress bars and starts trackers as the main one), and this run's logging, eval and save intervals
        # (transformers keeps the checkpoint's, with a warning). The callbacks' saved states come back where
        # `restore_callback_states_from_checkpoint` asks, as transformers restores them.
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self._load_callback_state()
        self.state.stateful_callbacks = stateful
        self.progress = TrainingProgress.from_dict(marker["progress"])
        # Value pretraining may have ended early in the saved run: its unused steps are not in the plan.
        self.state.max_steps = self.run_plan.max_steps(self.progress)
        # This call's, as transformers sets both after loading.
        self.state.num_train_epochs = self.run_plan.epochs(self.progress)
        self.state.compute_steps(self.args, self.state.max_steps)
        if self._reference_moves():
            reference_file = training_state_file(path, REFERENCE_FILE)
            if reference_file.is_file():
                load_placed_state_dict(self.ref_model, self.accelerator, load_file(reference_file))
            else:
                logger.warning(
                    f"{REFERENCE_FILE} is missing in {path} (written with sync_ref_model=False, or before trl-vapo "
                    "saved it): the KL penalty's reference restarts as the initial policy, not as it was synced."
                )
        rng_file = training_state_file(path, RNG_FILE.format(self.accelerator.process_index))
        if rng_file.is_file():  # loaded where the loop begins (`_restore_random_state`), as transformers loads it
            self._rng_state_file = rng_file
        else:
            logger.warning(f"{rng_file.name} is missing in {path}: the resumed run will not replay the same samples.")
        replay_file = training_state_file(path, REPLAY_FILE.format(self.accelerator.process_index))
        replays = self.progress.phase == VALUE_PRETRAIN and self.args.value_pretrain_replay > 0
        if replays and replay_file.is_file():
            self._replay = load_rollouts(str(replay_file), self.accelerator.device)[-self.args.value_pretrain_replay :]
        elif replays and self.progress.value_pretrain_rollouts:
            logger.warning(
                f"{replay_file.name} is missing in {path} (written with value_pretrain_replay=0, or before trl-vapo "
                "saved it): value pretraining's replay window starts anew."
            )
        logger.info(f"Resumed from {path} at step {self.state.global_step} ({self.progress.phase}).")
