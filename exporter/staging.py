"""Staging folders beside a destination, and what killed writers left of theirs.

A package (or adapter) is written into a hidden folder next to where it goes and renamed into place,
so a reader never sees half a package. A writer killed outright (the OOM killer, SIGKILL, a power cut)
cannot remove its folder, and a 7B export's is gigabytes in the user's cache. So each folder's name
carries its writer's process id and start time, and the next writer in the same place removes the
folders whose writer is gone (a live writer's, the same id reused by a later process included, are
left alone).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

# folders of an earlier naming (no writer in the name) are taken as abandoned after this long
UNNAMED_AFTER_S = 24 * 3600


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux: /proc/PID/stat's 22nd field); "0" where
    there is no /proc (then the id alone names the writer); None if no such process runs."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # someone else's process: alive
        return "0"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # fields after the command, which may hold spaces


def staging_dir(parent: Path, kind: str = "export") -> Path:
    """A fresh folder `.ruvllm-{kind}-{pid}.{start}-XXXX` in `parent`, after removing the abandoned ones of
    that kind there."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(parent, kind)
    me = f"{os.getpid()}.{_start_time(os.getpid())}"
    return Path(tempfile.mkdtemp(prefix=f".ruvllm-{kind}-{me}-", dir=parent))


def remove_abandoned(parent: Path, kind: str = "export") -> list[Path]:
    """Remove `parent`'s staging folders of `kind` whose writer no longer runs; returns them."""
    named = re.compile(rf"\.ruvllm-{re.escape(kind)}-(\d+)\.(\d+)-")
    removed = []
    for folder in parent.glob(f".ruvllm-{kind}-*"):
        m = named.match(folder.name)
        if m:
            gone = _start_time(int(m.group(1))) not in (m.group(2), "0")
        else:  # an earlier naming: abandoned once old
            try:
                gone = time.time() - folder.stat().st_mtime > UNNAMED_AFTER_S
            except OSError:
                continue
        if gone and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
