"""Run directories at a URI (``checkpoint.dir: gs://bucket/run``, or anything ``etils.epath`` opens with its
file-system package installed, e.g. ``gcsfs``): the run works in a local mirror and copies to the URI what it
has finished.

Everything that makes a run safe to stop and resume (Orbax's atomic step directories, the checksums, the
metrics rows cut back on resume, damaged steps set aside) works on local files, so the run keeps them local:
``<mirror root>/<scheme>/<bucket>/<path>`` (``$DSV41_RUN_MIRROR``, default ``~/.cache/dsv41_jax/runs``).
The URI receives:

- each checkpoint step once its save is confirmed (its checksums written): the step's files, then a marker
  ``checkpoints/<step>/.dsv41-complete`` written last, so a step whose upload was cut off is never taken for a
  finished one; steps that keep-last-K deleted locally are deleted there too;
- ``tokenizer.json`` once, and ``metrics.jsonl`` (rewritten whole) with every step and when the run ends.

Starting (or ``dsv41 sample --run URI``) first copies down what the mirror lacks: the tokenizer, the metrics
and every complete step. A new machine with an empty mirror therefore resumes where the URI is. The upload
runs on the training thread after the save is confirmed: a step's upload time is added to that step. One
process only: several processes must share ``checkpoint.dir`` on a file system they all mount (Orbax writes
one step from all of them).

Finished checkpoint directories (``dsv41 convert`` outputs, release-format directories) at a URI go the same
way, whole: :func:`local_copy` copies a directory down into its mirror the first time it is read (``--ckpt``,
``--hf-dir`` at a URI), and :func:`publish` copies a directory written locally up to its URI (``convert`` and
``export`` with ``--out`` at a URI), its completion file last (the manifest, the safetensors index), so a reader
never takes a cut-off upload for a finished one and a rerun of the same command sends it again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from dsv41_jax.config import ConfigError

MARK = ".dsv41-complete"
SIDE_FILES = ("tokenizer.json", "metrics.jsonl")


def is_uri(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def mirror_root() -> Path:
    return Path(os.environ.get("DSV41_RUN_MIRROR") or Path.home() / ".cache" / "dsv41_jax" / "runs")


def run_directory(directory: str | os.PathLike, what: str = "checkpoint.dir") -> Path:
    """The local directory a run (or checkpoint) at ``directory`` works in: the directory itself, or a URI's
    mirror. ``what`` names the key or flag in errors."""
    if not is_uri(directory):
        return Path(directory)
    scheme, rest = str(directory).split("://", 1)
    parts = [p for p in rest.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ConfigError(f"{what} {directory!r}: a URI needs a bucket and a path without '.' or '..'")
    return mirror_root().joinpath(scheme, *parts)


def _copy(src, dst) -> None:
    """One file, across file systems (local ↔ remote), streamed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout, 8 << 20)


def _send(pairs: list[tuple[object, object]], prefix: str) -> None:
    """Copy each ``(src, dst)`` file in order, with a progress line in bytes on stderr while it takes long (a
    release-size checkpoint is hundreds of GB)."""
    from dsv41_jax.checkpoint.progress import Progress

    stats = [src.stat() for src, _ in pairs]  # os.stat_result locally, epath's StatResult remotely
    sizes = [getattr(st, "st_size", None) or getattr(st, "length", 0) for st in stats]
    prog = Progress(sum(sizes), prefix=prefix)
    for (src, dst), n in zip(pairs, sizes, strict=True):
        _copy(src, dst)
        prog.advance(n, os.fspath(dst)[-60:])


def _files(root) -> list[tuple[str, object]]:
    """(relative path, path) of every file under ``root`` (local or remote), sorted."""
    from etils import epath

    root, out = epath.Path(root), []
    for directory, _, names in root.walk():
        for name in names:
            path = directory / name
            out.append((os.path.relpath(os.fspath(path), os.fspath(root)), path))
    return sorted(out, key=lambda item: item[0])


def local_copy(path: str | os.PathLike, marker: str, what: str, log: Callable[[str], None] = print) -> Path:
    """``path`` itself, or (a URI) its mirror holding the whole directory: copied down the first time, and again
    when the URI's ``marker`` (the file its writer writes last: a manifest, an index) no longer equals the
    mirror's. ``what`` names the flag."""
    if not is_uri(path):
        return Path(path)
    from etils import epath

    local, remote = run_directory(path, what), epath.Path(str(path))
    try:
        finished = (remote / marker).is_file()
        if finished and (local / marker).is_file():
            if (remote / marker).read_bytes() == (local / marker).read_bytes():
                return local
            log(f"{what} {path}: its {marker} changed since {local} was copied; copying it again")
    except Exception as err:  # no file-system package for the scheme, credentials, network
        if (local / marker).is_file():
            log(f"{what} {path}: cannot read it ({type(err).__name__}: {err}); using the copy in {local}")
            return local
        raise ConfigError(f"{what} {path}: cannot read it ({type(err).__name__}: {err})") from err
    if not finished:
        raise ConfigError(f"{what} {path}: no {marker} there; not a finished directory (an upload cut off, or "
                          "the wrong path)")
    files = [(rel, src) for rel, src in _files(remote) if rel != marker] + [(marker, remote / marker)]
    log(f"{what} {path}: copying {len(files)} files into {local}")
    tmp = local.with_name(f"{local.name}.dsv41-download")
    shutil.rmtree(tmp, ignore_errors=True)
    _send([(src, tmp / rel) for rel, src in files], "download")
    shutil.rmtree(local, ignore_errors=True)  # an earlier copy without its marker
    tmp.rename(local)
    return local


def remote_state(uri: str, marker: str, what: str) -> str:
    """``"finished"`` (``marker`` there), ``"empty"`` (nothing there) or ``"other"`` for the directory at ``uri``."""
    from etils import epath

    remote = epath.Path(uri)
    try:
        if (remote / marker).is_file():
            return "finished"
        return "other" if remote.exists() and (not remote.is_dir() or any(remote.iterdir())) else "empty"
    except Exception as err:
        raise ConfigError(f"{what} {uri}: cannot read it ({type(err).__name__}: {err})") from err


def publish(local: Path, uri: str, marker: str, log: Callable[[str], None] = print) -> None:
    """Copy the finished directory ``local`` to ``uri``, ``marker`` last; files already there are replaced."""
    from etils import epath

    remote = epath.Path(uri)
    files = _files(local)
    if (remote / marker).exists():
        (remote / marker).unlink()  # a reader must not take a half-replaced directory for a finished one
    ordered = [f for f in files if f[0] != marker] + [f for f in files if f[0] == marker]
    _send([(src, remote / rel) for rel, src in ordered], "upload")
    log(f"copied {len(files)} files from {local} to {uri}")


def local_source(path: str | os.PathLike, what: str, log: Callable[[str], None] = print) -> Path:
    """A ``dsv41 train`` run directory or a ``dsv41 convert`` output at ``path`` (``posttrain.init_from``), local:
    a URI holding ``checkpoints/`` is a run (:func:`local_run`), else a converted checkpoint (:func:`local_copy`)."""
    if not is_uri(path):
        return Path(path)
    from etils import epath

    from dsv41_jax.checkpoint.convert import MANIFEST

    try:
        is_run = (epath.Path(str(path)) / "checkpoints").is_dir()
    except Exception as err:
        raise ConfigError(f"{what} {path}: cannot read it ({type(err).__name__}: {err})") from err
    return local_run(path, log) if is_run else local_copy(path, MANIFEST, what, log)


def local_run(run: str | os.PathLike, log: Callable[[str], None] = print) -> Path:
    """The local directory of the run at ``run``: the path itself, or (a URI) its mirror after :meth:`RunMirror.pull`
    (``dsv41 sample / score / export / plot --run gs://...``)."""
    if not is_uri(run):
        return Path(run)
    mirror = RunMirror(str(run), log)
    mirror.pull()
    return mirror.local


class RunMirror:
    """The local mirror of a run at ``uri``: :meth:`pull` before the run starts, :meth:`push` as it goes."""

    def __init__(self, uri: str, log: Callable[[str], None] = print):
        from etils import epath

        self.uri, self.local, self.log = uri, run_directory(uri), log
        self.remote = epath.Path(uri)

    def _step_dirs(self) -> dict[str, object]:
        checkpoints = self.remote / "checkpoints"
        try:
            if not checkpoints.is_dir():
                return {}
            return {p.name: p for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir()}
        except Exception as err:  # no file-system package for the scheme, credentials, network
            raise ConfigError(f"checkpoint.dir {self.uri}: cannot list it ({type(err).__name__}: {err})") from err

    def pull(self) -> None:
        """Copy down the side files the mirror lacks and every complete step it does not hold."""
        steps = self._step_dirs()  # first: a URI that cannot be read is an error before anything is written
        self.local.mkdir(parents=True, exist_ok=True)
        for name in SIDE_FILES:
            src, dst = self.remote / name, self.local / name
            if not dst.exists() and src.is_file():
                _copy(src, dst)
        for name, src in sorted(steps.items(), key=lambda item: int(item[0])):
            dst = self.local / "checkpoints" / name
            if dst.exists():
                continue
            if not (src / MARK).is_file():
                self.log(f"{src}: an upload that never finished (no {MARK}); not copied")
                continue
            self.log(f"copying checkpoint step {name} from {src} to {dst}")
            tmp = dst.with_name(f"{name}.dsv41-download")
            shutil.rmtree(tmp, ignore_errors=True)
            _send([(path, Path(tmp) / rel) for rel, path in _files(src) if rel != MARK], "download")
            tmp.rename(dst)

    def push(self, step: int | None = None) -> None:
        """Copy ``step``'s directory (when given), then the side files; delete steps the mirror no longer holds."""
        if step is not None:
            src, dst = self.local / "checkpoints" / str(step), self.remote / "checkpoints" / str(step)
            _send([(path, dst / rel) for rel, path in _files(src)], "upload")
            (dst / MARK).write_text(f"{step}\n")
            held = {p.name for p in (self.local / "checkpoints").iterdir() if p.name.isdigit()}
            for name, stale in self._step_dirs().items():
                if name not in held:
                    stale.rmtree()
        for name in SIDE_FILES:
            src = self.local / name
            if src.is_file() and (name == "metrics.jsonl" or not (self.remote / name).exists()):
                _copy(src, self.remote / name)
