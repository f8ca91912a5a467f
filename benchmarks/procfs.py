"""What /proc says about a process's sockets: the TCP ports it listens on, the unix sockets it holds."""
from __future__ import annotations

import ipaddress
import os


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _hex_address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_addresses(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in owner:  # state LISTEN
                    addr, port = cols[1].split(":")
                    found.append((owner[cols[9]], str(_hex_address(addr)), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _workers_dir(core_pid: int) -> str:
    """The directory of the ipc sockets the engine core bound for its workers."""
    inodes = _socket_inodes(core_pid)
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) == 8 and cols[6] in inodes and "vllm-trace-workers-" in cols[7]:
                return os.path.dirname(cols[7])
    raise AssertionError("the engine core has no worker sockets")


def unix_socket_paths(pid: int) -> list[str]:
    """The paths of the unix-domain sockets (ipc:// endpoints) the process holds."""
    inodes = _socket_inodes(pid)
    paths = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) == 8 and cols[6] in inodes:
                paths.append(cols[7])
    return paths
