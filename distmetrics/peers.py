"""A rank that dies inside one of distmetrics' collectives is said as such, not as a bare backend error.

The arrival check (:mod:`distmetrics.guard`) names a rank that never reaches a guarded call; a rank
killed after it (SIGKILL, the OOM killer) dies inside the collectives that follow, where the survivors
get the backend's own error: gloo's ``Connection closed by peer`` or ``Connection reset by peer`` (a
plain ``RuntimeError`` in torch 2.13), or a ``torch.distributed.DistError``. Nothing there says it
happened in distmetrics, at which step or in which collective, so a user of a large job cannot tell a
metrics bug from a dead peer. The collective calls run inside :class:`InCollective`, which raises
:class:`PeerLostError` from that error: no collective more, and nothing on the healthy path but
entering it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from .guard import HangError, _describe

__all__ = ["PeerLostError", "InCollective"]


class PeerLostError(HangError):
    """A collective distmetrics made failed in the distributed backend: a peer rank has probably gone
    (crashed, killed, out of memory) inside it. The backend's error is its ``__cause__``. A
    :class:`~distmetrics.guard.HangError`, so one ``except`` covers a rank gone before a collective
    call (the arrival check's) and one gone inside it."""


class InCollective:
    """``with InCollective(collective, call, step): <one collective>``: a backend error raised inside is
    raised again as :class:`PeerLostError` from it, naming ``collective`` (what distmetrics was reducing
    there), the monitor ``call`` and ``step``. Only the backend's errors are turned: a ``DistError``
    (NCCL's, the store's), or the plain ``RuntimeError`` gloo raises; anything else, a subclass that is not
    the backend's (``NotImplementedError``, ``RecursionError``, ``torch.OutOfMemoryError``) included, goes
    by as it is. A class, not a generator: entering it costs a healthy log step next to nothing."""

    __slots__ = ("collective", "call", "step")

    def __init__(self, collective: str, call: str, step: Optional[int] = None) -> None:
        self.collective, self.call, self.step = collective, call, step

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Optional[BaseException], traceback: Any) -> bool:
        if err is None or not (isinstance(err, dist.DistError) or type(err) is RuntimeError):
            return False
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        said = " ".join(str(err).split()) or "(no message)"  # every line: NCCL names the cause on a later one
        if len(said) > _SAID_AT_MOST:
            said = said[:_SAID_AT_MOST] + " [...]"
        raise PeerLostError(
            f"distmetrics: the distributed backend failed on rank {rank} in {_describe(self.call, self.step)}, in "
            f"{self.collective}: {type(err).__name__}: {said} — {_reading(str(err))}. Look at the other ranks' logs "
            "and the launcher's (which rank ended first, on which signal) for the first failure") from err


_SAID_AT_MOST = 600
"""How much of the backend's message the error repeats (all of it is its ``__cause__``)."""
_GONE = ("closed by peer", "reset by peer", "connection refused", "broken pipe", "socket closed")
_LATE = ("timed out", "timeout")


def _reading(message: str) -> str:
    """What the backend's message says of the peers: gone (their connections closed), late (the
    process group's timeout passed with every rank perhaps alive: one slow, or in another call), or
    neither (a set-up or usage error: the message names it)."""
    lowered = message.lower()
    if any(word in lowered for word in _GONE):
        return ("a peer rank has probably gone (crashed, killed, out of memory) while the ranks were in this "
                "collective; distmetrics' metrics are not the cause unless every rank is still alive")
    if any(word in lowered for word in _LATE):
        return ("a peer rank did not join this collective within the process group's timeout: it is slow, in "
                "another call (a collective of its own, a checkpoint) or gone")
    return ("the backend's message above names the cause; where a peer rank has gone (crashed, killed, out of "
            "memory), this is how the others see it")
