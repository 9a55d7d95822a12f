"""Whose listening socket answers on a port: a server Belayer starts is used only once it is its own.

A port from ``free_port()`` was free when the OS picked it, not when the server binds it: in between,
another process (another job's router on the same node, another test) may take it, our server then fails
to bind, and a readiness probe (GET /workers, /health) is answered by that other process. An HTTP answer
cannot tell whose it is, so readiness also asks the kernel: ``/proc/net/tcp{,6}`` lists the socket inodes
listening on the port, and ``/proc/<pid>/fd`` of the started process and its descendants shows whether
they hold them. A listener our process holds cannot move to another process while ours lives, so a probe
sent after ``listener_ownership`` said OURS is answered by our server.

Linux only, as Belayer is (servers die with their parent through prctl). Servers started in-process with
aiohttp on port 0 (``http_serve.start_app``) need none of this: the OS picks the port while binding it.

Owns: finding who listens on a port and the port-clash rules. Must not: start servers.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Iterable, Union

# How many fresh ports a start tries when another process takes its port first. A clash needs another
# process to bind the same port within the few ms between free_port() and our bind; several in a row mean
# something else is wrong, and the start fails with the holders named.
PORT_ATTEMPTS = 5

# What a failed bind prints, in any case: "Address already in use (os error 98)" from the Rust router,
# "[Errno 98] ... address already in use" from aiohttp and uvicorn.
ADDRESS_IN_USE = "Address already in use"

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


class Ownership(enum.Enum):
    """Who holds the listening sockets that a connection to (host, port) can reach."""

    NONE = "none"  # nothing listens there yet
    OURS = "ours"  # every such listener is held by the process or its descendants
    FOREIGN = "foreign"  # at least one is held by another process: a probe may be answered by it


class PortClashError(RuntimeError):
    """Another process listens on the port a server Belayer started was meant to serve on."""

    def __init__(self, host: str, port: int, detail: str = ""):
        self.host, self.port = host, port
        super().__init__(f"port {port} on {host} is held by another process ({describe_holders(host, port)})"
                         + (f": {detail}" if detail else ""))


def _parse_addr(hex_addr: str) -> IPAddress:
    # /proc/net/tcp prints each 32-bit word of the address in host byte order.
    raw = bytes.fromhex(hex_addr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _host_addrs(host: str) -> set[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def _reaches(listen: IPAddress, targets: set[IPAddress]) -> bool:
    """Whether a listener on `listen` can take connections meant for `targets` (or clash with binding them)."""
    if isinstance(listen, ipaddress.IPv6Address) and listen.ipv4_mapped is not None:
        listen = listen.ipv4_mapped
    if listen.is_unspecified or any(t.is_unspecified for t in targets):
        return True  # a wildcard listener takes every address; binding the wildcard clashes with any
    return listen in targets


def listening_inodes(host: str, port: int) -> set[int]:
    """Socket inodes of every TCP listener on `port` that connections to `host` can reach (exact address,
    the wildcard, or IPv4-mapped IPv6), from this network namespace's /proc/net/tcp and tcp6."""
    targets = _host_addrs(host)
    out: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel or namespace
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != _LISTEN:
                continue
            addr, _, p = f[1].partition(":")
            if int(p, 16) == port and _reaches(_parse_addr(addr), targets):
                out.add(int(f[9]))
    return out


def tree_pids(pid: int) -> set[int]:
    """`pid` and its living descendants (a launcher may start the real server as a child); empty if gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.Error:
        return set()


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """Inodes of the sockets that the processes `pids` hold open (those /proc lets us read)."""
    out: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # exited, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


def listener_ownership(pid: int, host: str, port: int) -> Ownership:
    """Whether the listener on (host, port) belongs to process `pid` or its descendants.

    OURS only if at least one listener exists and every one is held by that tree: with SO_REUSEPORT two
    processes can listen on one port and the kernel spreads connections between them."""
    inodes = listening_inodes(host, port)
    if not inodes:
        return Ownership.NONE
    return Ownership.OURS if inodes <= socket_inodes(tree_pids(pid)) else Ownership.FOREIGN


def listener_holders(host: str, port: int) -> dict[int, str]:
    """pid -> command line of each process that holds a listener on (host, port), as far as /proc lets us
    see (another user's processes are hidden). Scans every process: for error messages, not polling."""
    inodes = listening_inodes(host, port)
    out: dict[int, str] = {}
    if not inodes:
        return out
    for entry in os.listdir("/proc"):
        if entry.isdigit() and socket_inodes([int(entry)]) & inodes:
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out[int(entry)] = cmd.strip()[:200]
    return out


def describe_holders(host: str, port: int) -> str:
    """A short text naming the processes that listen on (host, port)."""
    holders = listener_holders(host, port)
    if not holders:
        return "holder not visible" if listening_inodes(host, port) else "no listener now"
    return "; ".join(f"pid {pid}: {cmd}" for pid, cmd in holders.items())


def log_size(path: Union[str, Path]) -> int:
    """The size of a log now (0 if absent): pass it as `since` to read only what a new start writes."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_says_address_in_use(path: Union[str, Path], since: int = 0, tail_bytes: int = 8000) -> bool:
    """Whether a server's log, after offset `since`, reports a failed bind (how a clash the server lost
    shows). Logs are appended to across restarts, so an earlier start's failure must not count."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(since, f.tell() - tail_bytes))
            return ADDRESS_IN_USE.lower().encode() in f.read().lower()
    except OSError:
        return False
