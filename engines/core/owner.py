"""Who a process is, in a form that other processes (on this or another node) can judge later.

A pid alone names a process only on its own node, and only until it is reused. Lock files and
temporary names therefore record the host too, and a lock also records the process's start time
and the node's boot id: a holder is judged dead only on its own host, when its pid is gone, or
when the pid now belongs to a process that started later (or the node rebooted since).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional


def _boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> Optional[int]:
    """The start time of `pid` in clock ticks since boot (Linux `/proc`), None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after its last ')' are plain.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this node (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_tag(host: Optional[str] = None) -> str:
    """A short file-name-safe tag of a host name (host names may hold dots and dashes)."""
    name = socket.gethostname() if host is None else host
    return hashlib.sha1(name.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Owner:
    """The process that holds something: host, pid, start time and boot id."""

    host: str
    pid: int
    started: Optional[int] = None
    boot: Optional[str] = None

    @classmethod
    def current(cls) -> "Owner":
        pid = os.getpid()
        return cls(host=socket.gethostname(), pid=pid, started=process_start(pid), boot=_boot_id())

    @classmethod
    def from_dict(cls, data: Any) -> Optional["Owner"]:
        """Read a recorded owner; None for anything that is not one (a torn or foreign file)."""
        if not isinstance(data, dict) or not isinstance(data.get("host"), str) or type(data.get("pid")) is not int:
            return None
        started = data.get("started")
        boot = data.get("boot")
        return cls(host=data["host"], pid=data["pid"], started=started if type(started) is int else None,
                   boot=boot if isinstance(boot, str) else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> Optional[bool]:
        """True or False for an owner on this host; None for one on another host, which cannot be judged here."""
        if not self.on_this_host():
            return None
        boot = _boot_id()
        if self.boot is not None and boot is not None and self.boot != boot:
            return False  # the node rebooted since
        if not pid_alive(self.pid):
            return False
        started = process_start(self.pid)
        if self.started is not None and started is not None and started != self.started:
            return False  # the pid was reused by a later process
        return True
