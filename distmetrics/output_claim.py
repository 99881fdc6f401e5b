"""The writer's hold on ``output_dir`` (:class:`OutputClaim`): one Monitor writes a run folder at a
time, in this process or any other, and a forked child never lets go of its parent's hold."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Optional

from .sinks.appendfile import describe_os_error
from .sinks.jsonl import METRICS_FILE

__all__ = ["OutputClaim", "output_dir_problem", "unmakeable", "not_files", "file_notes"]

logger = logging.getLogger("distmetrics")
_LOCK_TRIES = 5
_LOCK_NAME = ".distmetrics.lock"


class OutputClaim:
    """The writer's hold on ``output_dir``: an exclusive lock on ``{output_dir}/.distmetrics.lock``
    (released at close or when the process ends), refused while another Monitor holds it. A forked
    child closes its copy of the lock's file descriptor at once (:func:`_let_go_in_child`): a flock
    lasts while any descriptor of it is open, so a child outliving a killed trainer (a DataLoader
    worker, an uploader) would otherwise keep the next job out. A lock file removed with its folder
    while held is taken again before a sink makes its file there again (:meth:`reclaim`)."""

    def __init__(self, config: Any) -> None:
        self.problem: Optional[str] = None
        self._file: Any = None
        self._held: Optional[Path] = None
        self._busy = False  # the last try found another Monitor holding the lock
        self._retake: Optional[Path] = None  # the folder whose removed lock reclaim() could not take again yet
        self._mutex = threading.Lock()  # reclaim() runs on the training thread and the writer thread
        if not _writes_there(config):
            return
        path = Path(config.output_dir)
        odd = not_files(config, path)
        if odd:
            self.problem = (f"output_dir={str(path)!r} cannot be written on the writer rank ({socket.gethostname()}): "
                            f"{odd}")
            return
        for note in file_notes(config, path, unsaid=True):  # the others: their sink fails at start, and says so
            logger.warning("distmetrics: %s", note)
        for _ in range(_LOCK_TRIES):
            if not self._lock(path) or self._held is not None or self.problem is not None:
                return
        self.release()  # the file was replaced under us every time: another writer keeps starting
        self.problem = f"output_dir={str(path)!r} is in use by other Monitors starting there at the same time"

    def _lock(self, path: Path) -> bool:
        """One try to hold the lock file; False when there is nothing to hold (``problem`` says
        why, or the file system cannot lock), True otherwise; ``_held`` is set once held. A lock
        on a file that a closing Monitor unlinked meanwhile holds nothing: that try ends without it."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / _LOCK_NAME, "a+")
        except OSError as err:
            self.release()
            self.problem = (f"output_dir={str(path)!r} cannot be written on the writer rank "
                            f"({socket.gethostname()}): {describe_os_error(err)}")
            return False
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # A file system without flock (some NFS or Lustre mounts): the folder is writable,
                # only the guard against a second writer is missing.
                logger.warning("distmetrics: output_dir=%r cannot be locked (%s); a second Monitor writing there "
                               "would not be refused: give each job its own output_dir.", str(path),
                               describe_os_error(err))
                self.release()
                (path / _LOCK_NAME).unlink(missing_ok=True)  # it locks nothing here
                return False
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._busy = True
            self.release()
            self.problem = (f"output_dir={str(path)!r} is in use by another Monitor ({holder}); two writers would "
                            "interleave their records: give each job its own output_dir")
            return True
        try:
            same = os.fstat(self._file.fileno()).st_ino == os.stat(path / _LOCK_NAME).st_ino
        except OSError:
            same = False
        if not same:  # the Monitor that held it closed and unlinked it between our open and lock
            self.release()
            return True
        self._held = path / _LOCK_NAME
        _HELD.add(self)
        try:  # who holds it, for a refused second writer's message; a full disk leaves it out
            os.ftruncate(self._file.fileno(), 0)  # past the text layer: nothing left buffered to fail at close
            os.pwrite(self._file.fileno(), f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError as err:
            logger.warning("distmetrics: output_dir=%r: the lock is held but who holds it could not be written "
                           "(%s); the metric files will say what they can write.", str(path),
                           describe_os_error(err))
        return True

    def reclaim(self) -> None:
        """Take the lock again where its file was removed with ``output_dir`` while held (a sink is
        about to make its removed file there again), so a second Monitor is still refused there.
        Raises OSError: EBUSY where another Monitor took the folder meanwhile (each later call tries
        again), or the folder's own error. Held in place, or moved with its folder: nothing to do."""
        with self._mutex:
            folder = self._held.parent if self._held is not None else self._retake
            if folder is None or (self._held is not None and os.fstat(self._file.fileno()).st_nlink > 0):
                return  # nothing held (no flock on this file system), or held still
            if self._held is not None:
                _HELD.discard(self)
                self._held = None
                self.release()  # the file removed: closed, nothing unlinked
            self._retake, self._busy = folder, False  # until it is held again
            folder.mkdir(parents=True, exist_ok=True)  # its error, not the lock's, where it cannot be made
            for _ in range(_LOCK_TRIES):
                if not self._lock(folder) or self._held is not None or self.problem is not None:
                    break
            problem, self.problem = self.problem, None
            if self._held is None and (self._busy or problem is not None):
                raise OSError(errno.EBUSY if self._busy else errno.EIO, f"{folder} was removed while this run wrote "
                              f"it, and it cannot be taken again: {problem}")
            self._retake = None  # held again (or no flock here: warned)

    def release(self) -> None:
        """Let another Monitor write ``output_dir`` (the lock file goes; a killed process leaves
        a file that no longer locks anything)."""
        if self._held is not None:
            self._held.unlink(missing_ok=True)
            self._held = None
            _HELD.discard(self)
        if self._file is not None:
            self._file.close()
            self._file = None


def output_dir_problem(config: Any) -> Optional[str]:
    """Why the writer could not make or write ``output_dir`` (None where it can, or writes nothing
    there), found as :func:`unmakeable` finds it: nothing is made, locked or left, so ``distmetrics
    check-config`` can say it before a job starts. Another Monitor holding the folder is not said:
    that is the state of a moment, not of the config."""
    if not _writes_there(config):
        return None
    problem = unmakeable(Path(config.output_dir)) or not_files(config, Path(config.output_dir))
    if not problem:
        return None
    return (f"output_dir={config.output_dir!r} cannot be written: {problem}; accepted: a folder the writer rank can "
            "make, or one it can write")


def unmakeable(folder: Path) -> str:
    """Why ``folder`` cannot be made (or written, where it is): the first part of it that exists is
    not a folder, or nothing can be made in it; '' if it can. That a folder can be made there is
    tried (one made and removed at once), since permission bits do not tell it: root may write
    everywhere by them, yet nothing can be made under ``/proc``. Nothing is left behind: whatever it
    finds, the folders are as they were (a Monitor refused at start leaves ``output_dir`` alone)."""
    folder = folder.absolute()
    for part in (folder, *folder.parents):
        if os.path.lexists(part):
            if not part.is_dir():
                return f"{part} is not a folder"
            try:
                made = tempfile.mkdtemp(prefix=".distmetrics-check-", dir=part)
            except OSError as err:
                return f"no folder can be made in {part} ({err.strerror or err})"
            try:
                os.rmdir(made)
            except OSError as err:  # made, so it can be: only its removal failed, said, not a refusal
                logger.warning("distmetrics: could not remove the folder %s made to check %s (%s)", made, part, err)
            return ""
    return ""


def not_files(config: Any, folder: Path) -> str:
    """Which of the run's own files in ``folder`` is a named pipe, '' if none: the writer reads metrics.jsonl's
    last record and progress.txt at start-up (a resumed run's), and from a named pipe it waited for a writer
    forever, the other ranks at the start-up gather. (A folder there fails that read at once: that sink is
    turned off with a warning, as a sink that fails is.)"""
    for name, on in ((METRICS_FILE, config.json_log), ("progress.txt", config.log_progress)):
        path = folder / name
        try:
            pipe = on and stat.S_ISFIFO(os.stat(path).st_mode)
        except OSError:  # none there (or no folder): nothing to wait on
            continue
        if pipe:
            return f"{path} is a named pipe (FIFO), not a file: the writer would wait on it forever"
    return ""


def file_notes(config: Any, folder: Path, unsaid: bool = False) -> list[str]:
    """What stands in place of the run's own files in ``folder`` that keeps no record, said but not refused
    (a sink there is turned off with a warning, or writes into nothing): a folder, a link to a path that
    does not exist, something that is not a regular file (a link to /dev/null took every record unsaid).
    ``unsaid``: only what no sink says (the last kind), for the Monitor to warn of."""
    notes: list[str] = []
    for name, on in ((METRICS_FILE, config.json_log), ("progress.txt", config.log_progress)):
        path = folder / name
        if not on or not os.path.lexists(path):
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError as err:  # a link to nothing: writing makes the file, where its folder is there
            if unsaid:
                continue
            if err.errno == errno.ELOOP:
                notes.append(f"{path} is a link that leads back to itself: its sink is turned off with a warning")
            elif not os.path.isdir(os.path.dirname(os.path.realpath(path))):
                notes.append(f"{path} is a link to {os.readlink(path)!r}, whose folder is missing or no folder: its "
                             "sink is turned off with a warning")
            continue
        if stat.S_ISDIR(mode):
            notes += [] if unsaid else [f"{path} is a folder: its sink is turned off with a warning"]
        elif not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):  # (a named pipe is refused: not_files)
            target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
            notes.append(f"{path} is no regular file{target}: what is written there is not kept")
    return notes


def _writes_there(config: Any) -> bool:
    """Whether the writer makes files in ``output_dir``: metrics.jsonl, progress.txt, or the
    TensorBoard folder where ``tensorboard_dir`` does not name another."""
    return bool(config.json_log or config.log_progress or (config.tensorboard and not config.tensorboard_dir))


_HELD: "weakref.WeakSet[OutputClaim]" = weakref.WeakSet()  # the claims this process holds


def _let_go_in_child() -> None:
    """In a forked child: close the inherited descriptors of the parent's locks, and forget them, so
    nothing in the child (no release(), no exit) unlinks the parent's lock file. Closing a copy does
    not unlock: the parent's own descriptor keeps the lock."""
    for claim in list(_HELD):
        claim._held = None
        claim.release()
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)  # once per process: a child inherits the registration
