"""Unix-domain-socket listeners for the sidecar's doors: claiming the path, permissions, removal.

A door on a socket file is reachable only by the processes the file's mode and group let in
(the database's user, say), with no TCP port at all. `claim()` refuses a path that is not a
socket and a socket another process still listens on, and removes a stale one left by a dead
process; the socket is created owner-only (a umask, so that no other user can connect before
`chmod`), then given its mode and group; `remove()` deletes it on shutdown unless another
process has replaced it meanwhile.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODE = 0o600
# sockaddr_un's sun_path holds 108 bytes, the terminating NUL included.
MAX_PATH_BYTES = 107


def parse_mode(text: str) -> int:
    """An octal permission mode such as "0660" or "660"; ValueError naming the text otherwise."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise ValueError(f"socket mode {text!r} is not an octal number such as 0600 or 0660") from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"socket mode {text!r} is out of range (0000 to 0777)")
    return mode


def group_id(group: str) -> int:
    """The id of `group`, a name or a number; ValueError naming it when this host has no such group."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"socket group {group!r}: no such group on this host") from None


@dataclass(frozen=True)
class UnixSocket:
    """A socket file to listen on: its path, the mode it gets, and optionally its group."""

    path: Path
    mode: int = DEFAULT_MODE
    group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(os.path.abspath(self.path)))
        if len(os.fsencode(self.path)) > MAX_PATH_BYTES:
            raise ValueError(f"socket path {str(self.path)!r} is longer than the {MAX_PATH_BYTES} bytes "
                             "a Unix socket address holds: choose a shorter one")
        if not 0 <= self.mode <= 0o777:
            raise ValueError(f"socket {self.path}: mode {self.mode:#o} is out of range (0000 to 0777)")
        if self.group is not None:
            group_id(self.group)

    @property
    def address(self) -> str:
        """The gRPC address of the socket, "unix:/abs/path"."""
        return f"unix:{self.path}"

    def with_path(self, path: str | os.PathLike) -> "UnixSocket":
        """The same mode and group at another path."""
        return UnixSocket(Path(path), self.mode, self.group)


def claim(path: Path) -> None:
    """Make `path` free to bind: remove a stale socket; OSError naming the path for anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise FileNotFoundError(f"socket {path}: the directory {path.parent} does not exist") from None
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(f"socket {path}: the path exists and is not a socket; refusing to replace "
                              "it (remove it, or choose another path)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: a socket left by a process that died
        path.unlink(missing_ok=True)
        return
    except FileNotFoundError:
        return
    except OSError as error:
        raise OSError(f"socket {path}: cannot tell whether another process listens on it "
                      f"({error.strerror}); refusing to replace it") from None
    finally:
        probe.close()
    raise OSError(f"socket {path}: another process is listening on it")


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """A umask under which bind() creates an owner-only socket file (the umask is process-wide,
    so this is held only around a bind)."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def secure(spec: UnixSocket) -> int:
    """Give the bound socket file its mode and group; returns its inode, for `remove()`."""
    try:
        if spec.group is not None:
            os.chown(spec.path, -1, group_id(spec.group))
        os.chmod(spec.path, spec.mode)
    except OSError as error:
        spec.path.unlink(missing_ok=True)
        what = f"group {spec.group!r}" if spec.group is not None else f"mode {spec.mode:#o}"
        raise OSError(f"socket {spec.path}: cannot set its {what} ({error.strerror})") from None
    return os.lstat(spec.path).st_ino


def bind(spec: UnixSocket, backlog: int = 1024) -> tuple[socket.socket, int]:
    """A listening socket at `spec.path`, with its mode and group, and the file's inode."""
    claim(spec.path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only():
            sock.bind(str(spec.path))
        inode = secure(spec)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock, inode


def remove(path: Path, inode: int | None) -> None:
    """Delete the socket file at `path` if it is still the one bound (inode `inode`; None: none was)."""
    if inode is None:
        return
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and info.st_ino == inode:
            path.unlink()
