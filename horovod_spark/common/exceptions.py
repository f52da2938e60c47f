"""Horovod's ``horovod.common.exceptions``: what an elastic training loop catches.

`HorovodInternalError` is a collective that failed because a peer is gone or disagrees
(`collectives.errors.CollectiveError`, what every adapter raises); `HostsUpdatedInterrupt`
is the elastic state's "the world changed".
"""
from collectives.errors import CollectiveError as HorovodInternalError

from .elastic import HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
