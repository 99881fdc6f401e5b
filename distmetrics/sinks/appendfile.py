"""A file that grows by whole records only, for the sinks that write files (JSONL, TensorBoard,
progress.txt).

A write that fails (disk full, quota, I/O error) is cut back off, so the file never ends in a
torn record; every later record is tried again, so writing resumes by itself when space
returns. What could not be written is counted and said: one warning when writing starts to
fail (the path, the errno and its text), one when it works again (how many records, which
steps), and one at close if it never did; an outage beginning within :data:`FLAPPING_S` of the last
one's end is not said while it loses at most :data:`FLAPPING_RECORDS` records, but counted in the next
warning (a disk so nearly full that it fails and works again at every record would say both each time).

A file removed while it is written (``rm -r`` of the run folder) would take every later record
with it, as the writes go on into the unlinked file: at most once a second (:data:`CHECK_EVERY_S`)
an append looks whether the file still has a name (``st_nlink``); where it has none and its path
names no file or another one, one warning says so, the folder and file are made again (starting
with the file's first header) and writing goes on there. A file renamed or moved with its folder
keeps a name: it is followed, not made again.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

__all__ = ["AppendFile", "Lost", "describe_os_error", "CHECK_EVERY_S"]

logger = logging.getLogger("distmetrics")
CHECK_EVERY_S = 1.0
"""How often, at most, an append looks whether its file was removed (an ``fstat``, ~1 us: not per record)."""
try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, OSError, ValueError):  # no such limit known: POSIX's least, as Linux's
    IOV_MAX = 1024
"""The most pieces one ``os.writev`` takes (Linux: 1,024); more, and it fails with EINVAL every time."""
FLAPPING_S = 600.0
"""An outage that starts within this many seconds of the last one's end (a disk so nearly full that a
small record fits between two that do not) is not said, neither its failure nor its end, while it has
lost at most :data:`FLAPPING_RECORDS` records: its gap record marks it, and the next outage said, or
close(), counts it. Else each log step could say both. One that loses more is said then, as any."""
FLAPPING_RECORDS = 2


@dataclass
class Lost:
    """Records that could not be written since writing last worked."""

    first_step: int
    last_step: int
    records: int
    error: str
    """The first failure, e.g. ``[Errno 28] No space left on device (ENOSPC)``."""
    held: int = 0
    """Records kept to be written later (``append(keep=True)``), not counted in ``records``."""
    quiet: bool = False
    """Said already (the file was removed): writing again is not announced."""
    hushed: bool = False
    """Begun within :data:`FLAPPING_S` of the last outage's end: neither it nor its end is said."""


class AppendFile:
    """Appends whole records to ``path``; a failed append leaves the file as it was.

    ``lines=True``: the records are text lines; a torn last line left by a crash (a process
    killed in the middle of a write) is cut off when the file is opened, so the file reads
    whole; ``whole(head, complete)``: where given, a last line without its newline that it takes for
    records (``head``: its first :data:`_WHOLE_LINE_LIMIT` bytes, ``complete``: all of it) is kept,
    its newline added (a copy or an edit by another tool, ``\r`` line endings too). ``sink`` names
    the sink in warnings; ``on_loss`` names what marks lost records
    (e.g. ``a "gap" record``). ``reclaim``: called before a removed file is made again (the
    writer's lock on its folder taken again); an OSError it raises counts the record as lost.
    """

    def __init__(self, path: Union[str, Path], sink: str, lines: bool = True, on_loss: str = "",
                 reclaim: Optional[Callable[[], None]] = None,
                 whole: Optional[Callable[[bytes, bool], bool]] = None) -> None:
        self.path = Path(path)
        self._whole = whole
        self.sink = sink
        self.on_loss = on_loss
        self.reclaim = reclaim
        self.lost: Optional[Lost] = None
        self._lines = lines
        self._held: list = []  # pieces of a header not written yet (append_header), and its step
        self._held_step = 0
        self._headers: list = []  # every header's pieces (append_header): what a file made again starts with
        self._headers_written = 0  # how many of them were written (the others are held)
        self._cut_at: Optional[int] = None  # where a partial record could not be cut off yet
        self._fd, self._end = self._open()  # the file's size, as far as this process knows
        self.check_at = time.monotonic() + CHECK_EVERY_S
        """When (``time.monotonic()``) the next look at the file is due (:meth:`check`)."""
        self._removed: Optional[OSError] = None  # why a removed file could not be made again yet
        self.last_step = 0
        """The step of the last append (what a look at close names)."""
        self._since = self._since_first = self._since_last = 0  # records written since the last check, their steps
        self._calm_at = 0.0  # time.monotonic() from which a new outage is said again (FLAPPING_S after the last
        # outage of failed writes: a removed file's records lost are no failure of the disk)
        self._unsaid = [0, 0]  # outages not said (FLAPPING_S), and the records they lost

    @property
    def is_open(self) -> bool:
        """Whether the file is open (a signal handler's close may have closed it under a write)."""
        return self._fd >= 0

    def append_header(self, data: Union[bytes, Sequence[bytes]], step: int) -> bool:
        """Write ``data``, which is not a record but what must precede the records after it (a
        file's first event, a job's ``run`` record or "Starting job" line, TensorBoard's order to
        drop an earlier job's steps). If it cannot be written it is held, not counted as lost,
        and written ahead of the next record, or at ``close()``; True if written now. The first
        headers written are written again at the start of a file made again after it was removed."""
        self._headers.append(list(_pieces(data)))
        self.hold(data, step)
        return self.append((), step, counts=False)

    def hold(self, data: Union[bytes, Sequence[bytes]], step: int) -> None:
        """Keep ``data`` to write ahead of the next record (or at ``close()``), without trying now."""
        if not self._held:
            self._held_step = step
        self._held.extend(_pieces(data))

    def append(self, data: Union[bytes, Sequence[bytes]], step: int, counts: bool = True,
               closing: bool = False, keep: Union[bytes, Sequence[bytes], None] = None) -> bool:
        """Write ``data`` (bytes, or pieces written one after the other in one system call, not
        joined first) whole at the end of the file, behind any held header
        (:meth:`append_header`); on an OSError cut it back off, count the record as lost
        (``step`` names it; not with ``counts=False``) and return False. ``closing``: the last
        write before :meth:`close` (a mark of the records lost), so no "again from" is said.
        ``keep``: where it fails, this record (its pieces without any other written with it) is held
        (:meth:`hold`) and written ahead of the next record, not lost; counted as lost only if it
        never is. A failure is warned about either way. Closed (by a signal handler's close, inside
        this write): nothing is written, nothing said (the Monitor says what its close cut off).
        First, at most once a second, whether the file was removed (:meth:`check`)."""
        if self._fd < 0:
            return False
        self.last_step = step
        if time.monotonic() >= self.check_at:
            self.check(step)
        pieces = _pieces(data)
        if self._held:
            pieces = [*self._held, *pieces]
        if len(pieces) > IOV_MAX:  # the records a long outage held (3 pieces each): one buffer, else never written
            pieces = [b"".join(pieces)]
        size = sum(map(len, pieces))
        done = 0
        try:
            if self._removed is not None:  # removed, and its folder or file could not be made again
                raise self._removed.with_traceback(None)
            if self._cut_at is not None:
                os.ftruncate(self._fd, self._cut_at)
                self._end, self._cut_at = self._cut_at, None
            done = os.writev(self._fd, pieces)
            if done < size:  # a short write (the disk filling up): the rest, until it raises
                view = memoryview(b"".join(pieces))[done:]
                while view:
                    wrote = os.write(self._fd, view)
                    done, view = done + wrote, view[wrote:]
        except OSError as err:
            self._roll_back(done)
            if keep is not None:
                self._failing(err, step).held += 1
                self.hold(keep, step)
            elif counts:
                self._count_lost(err, step)
            return False
        self._end += size
        self._held, self._headers_written = [], len(self._headers)
        if counts:
            if not self._since:
                self._since_first = step
            self._since, self._since_last = self._since + 1, step
        if self.lost is not None:
            lost, self.lost = self.lost, None
            if not lost.quiet:
                self._calm_at = time.monotonic() + FLAPPING_S
            if lost.hushed:  # its gap record marks it; the next outage said, or close(), counts it
                if lost.records:  # else only kept records waited, and went ahead: nothing lost
                    self._unsaid[0] += 1
                    self._unsaid[1] += lost.records
                return True
            if lost.quiet:  # the file was removed: its warning said what was lost
                return True
            again = "closes %s" if closing else "writes %s again from step %d"
            kept = f"; {lost.held} kept meanwhile went ahead" if lost.held else ""
            if lost.records:
                logger.warning(f"distmetrics: the %s sink {again}; %d record%s (steps %d-%d) could not be written%s%s.",
                               self.sink, self.path, *(() if closing else (step,)), lost.records,
                               "" if lost.records == 1 else "s", lost.first_step, lost.last_step,
                               f"; {self.on_loss} marks them" if self.on_loss else "", kept)
            else:
                logger.warning(f"distmetrics: the %s sink {again}; no record was lost%s.",
                               self.sink, self.path, *(() if closing else (step,)), kept)
        return True

    def close(self) -> None:
        """Close the file; warn if records were still failing to be written."""
        if self._fd < 0:
            return
        self.check(self.last_step, closing=True)  # records since the last look may have gone with a removed file
        if self._held:  # a header that never found a record to precede it: now or never (counted, unless
            # records were lost too: the warning below counts those)
            self.append((), self._held_step if self.lost is None else self.lost.last_step, counts=self.lost is None)
        if self._cut_at is not None:
            try:
                os.ftruncate(self._fd, self._cut_at)
            except OSError:
                pass  # warned when it first failed
        os.close(self._fd)
        self._fd = -1
        if self.lost is not None and not self.lost.quiet:
            lost = self.lost
            records = lost.records + lost.held  # the kept ones found no room either
            logger.warning("distmetrics: the %s sink closed %s with %d record%s (steps %d-%d) not written: %s%s.",
                           self.sink, self.path, records, "" if records == 1 else "s",
                           lost.first_step, lost.last_step, lost.error, self._take_unsaid())
        elif self._unsaid[0]:
            logger.warning("distmetrics: the %s sink closed %s: %s.", self.sink, self.path,
                           self._take_unsaid(lead=""))

    def _take_unsaid(self, lead: str = "; besides, ") -> str:
        """``; besides, 3 more outages began ...``: the outages not said since the last one said (none: "")."""
        (outages, records), self._unsaid = self._unsaid, [0, 0]
        if not outages:
            return ""
        return (f"{lead}{outages} more outage{'' if outages == 1 else 's'} began within {FLAPPING_S:g} s of the "
                f"one before (the disk nearly full) and lost {records} record{'' if records == 1 else 's'}"
                + (f", each marked by {self.on_loss}" if self.on_loss else "") + ", not said each time")

    def check(self, step: int, closing: bool = False) -> None:
        """Whether the file was removed, at most once a second (every call ``closing``); where it
        was, say so once and make the folder and file again (:meth:`_open_again`). Removed: it has
        no name left (``st_nlink`` 0) and its path names no file or another one (a file system that
        reports no links for a file in place does not count); a renamed file has a name: followed."""
        if self._fd < 0 or not (closing or time.monotonic() >= self.check_at):
            return
        self.check_at = time.monotonic() + CHECK_EVERY_S
        if self._removed is None:
            if not self._was_removed():
                self._since = 0
                return
            self._say_removed(step, closing)
        try:
            self._open_again()
        except OSError as err:  # each record tries again; counted as lost meanwhile
            self._removed, self.check_at = err, 0.0
        else:
            self._removed = None

    def _was_removed(self) -> bool:
        try:
            st = os.fstat(self._fd)
        except OSError:
            return False
        if st.st_nlink > 0:
            return False
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)

    def _say_removed(self, step: int, closing: bool) -> None:
        """The file was removed: the records written since the last look (at most a second ago)
        went with it, counted as lost (the JSONL sink's gap record marks them)."""
        count, first, last = self._since, self._since_first, self._since_last
        self._since = 0
        folder = "file is" if self.path.parent.is_dir() else "file and its folder are"
        if count:
            lost = self.lost
            if lost is None:
                error = f"{self.path} was removed while the run was writing it"
                self.lost = Lost(first, last, count, error, quiet=True)
            else:
                lost.first_step, lost.last_step = min(lost.first_step, first), max(lost.last_step, last)
                lost.records += count
            what = (f"up to {count} record{'' if count == 1 else 's'} (steps {first}-{last}) written since it was "
                    f"last seen in place went with it" + (f"; {self.on_loss} marks them" if self.on_loss else ""))
        else:
            what = "no record was written since it was last seen in place"
        logger.warning("distmetrics: the %s sink's file %s was removed while the run was writing it (found %s): %s. "
                       "The %s made again and what follows is written there.", self.sink, self.path,
                       "at close" if closing else f"at step {step}", what, folder)

    def _open_again(self) -> None:
        """Open the path anew (the folder made again, the writer's lock taken again), starting with
        the headers written to the file removed; the file removed is let go."""
        if self.reclaim is not None:
            self.reclaim()
        fd, end = self._open()
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd, self._end, self._cut_at = fd, end, None  # a partial record left was in the file removed
        written = [piece for header in self._headers[:self._headers_written] for piece in header]
        if written:  # again, ahead of those still held (TensorBoard's drop of an earlier job's steps too, which,
            if not self._held:  # lost with the file, let that job's values at them show again)
                self._held_step = self.last_step
            self._held = [*written, *self._held]
            self._headers_written = 0

    def _open(self) -> tuple[int, int]:
        """The file opened for appending (its folder made), and its size once a torn last line is cut off."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # every write at the end
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            return fd, self._cut_torn_line(fd, end) if self._lines and end > 0 else end
        except BaseException:
            os.close(fd)
            raise

    def _failing(self, err: OSError, step: int) -> Lost:
        """Writing fails: said at the first failure since writing last worked (or since the file
        was removed, which was said)."""
        if self.lost is not None and self.lost.quiet:
            self.lost.quiet = False  # writing again will be said
            self.lost.error += f"; then {describe_os_error(err)}"
            logger.warning("distmetrics: the %s sink cannot write %s at step %d: %s; every later record is tried "
                           "again.", self.sink, self.path, step, describe_os_error(err))
        if self.lost is None:
            self.lost = Lost(step, step, 0, describe_os_error(err), hushed=time.monotonic() < self._calm_at)
            if not self.lost.hushed:
                self._say_failing(step)
        return self.lost

    def _say_failing(self, step: int) -> None:
        logger.warning("distmetrics: the %s sink cannot write %s at step %d: %s. The file still ends with a whole "
                       "record; every later record is tried again%s%s.", self.sink, self.path, step, self.lost.error,
                       f", and {self.on_loss} will mark the steps lost" if self.on_loss else "", self._take_unsaid())

    def _count_lost(self, err: OSError, step: int) -> None:
        lost = self._failing(err, step)
        if lost.records == 0:
            lost.first_step = lost.last_step = step
        lost.first_step = min(lost.first_step, step)
        lost.last_step = max(lost.last_step, step)
        lost.records += 1
        if lost.hushed and lost.records > FLAPPING_RECORDS:  # no blip: a disk full again, said as any outage
            lost.hushed = False
            self._say_failing(lost.first_step)

    def _roll_back(self, written: int) -> None:
        """Cut off the ``written`` bytes of a record that could not be written whole."""
        if self._cut_at is not None:  # the failure was cutting off an earlier partial record
            return
        if not written:
            return
        start = self._end  # where the record began, unless another process appended since
        try:
            start = os.fstat(self._fd).st_size - written
            os.ftruncate(self._fd, start)
        except OSError as err:  # tried again before the next append
            self._cut_at = start
            logger.warning("distmetrics: the %s sink could not cut a partly written record off %s: %s",
                           self.sink, self.path, describe_os_error(err))

    def _cut_torn_line(self, fd: int, size: int) -> int:
        """Cut everything after the last newline (a line a crash cut short); the new size."""
        with open(self.path, "rb") as f:
            pos = size
            while pos > 0:
                start = max(0, pos - 65536)
                f.seek(start)
                newline = f.read(pos - start).rfind(b"\n")
                if newline >= 0:
                    pos = start + newline + 1
                    break
                pos = start
        if pos == size:
            return size
        if self._whole is not None:
            with open(self.path, "rb") as f:
                f.seek(pos)
                head = f.read(min(size - pos, _WHOLE_LINE_LIMIT))
            if self._whole(head, pos + len(head) == size):
                try:
                    size += os.write(fd, b"\n")
                except OSError:  # a full disk: written ahead of the first record (cutting needs no room, this does)
                    self._held.insert(0, b"\n")
                logger.warning("distmetrics: the last line of %s holds records but had no newline (a copy or an edit "
                               "by another tool, or a write that stopped just before it): the %s sink keeps it and "
                               "adds one before appending.", self.path, self.sink)
                return size
        os.ftruncate(fd, pos)
        logger.warning("distmetrics: the %s sink cut %d bytes of a torn last line (a crash during a write) off %s "
                       "before appending.", self.sink, size - pos, self.path)
        return pos


_WHOLE_LINE_LIMIT = 128 << 20
"""The most of a last line without its newline read to tell whether it holds records."""


def _pieces(data: Union[bytes, Sequence[bytes]]) -> Sequence[bytes]:
    return (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data


def describe_os_error(err: OSError) -> str:
    """``[Errno 28] No space left on device (ENOSPC)``, with the path when the error has one."""
    if err.errno is None:
        return f"{type(err).__name__}: {err}"
    name = _errno.errorcode.get(err.errno, "")
    text = f"[Errno {err.errno}] {err.strerror or err}" + (f" ({name})" if name else "")
    if err.filename is not None:
        text += f": {err.filename}"
    return text
