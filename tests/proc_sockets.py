"""The listening TCP sockets a process holds, read from /proc (Linux): for tests that check where a server
listens. Importable from every test directory (tests/ is on sys.path through tests/conftest.py)."""

import os
import socket
import struct


def socket_inodes(pid: int) -> set:
    """The inode numbers (as text) of the sockets process ``pid`` has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_sockets(pid: int) -> set:
    """``(address, port)`` of every listening TCP socket of process ``pid``; an IPv6 address is given as
    ``tcp6:<hex>``."""
    inodes = socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            hexaddr, hexport = fields[1].split(":")
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address = socket.inet_ntoa(struct.pack("<I", int(hexaddr, 16))) if table == "tcp" else f"tcp6:{hexaddr}"
            found.add((address, int(hexport, 16)))
    return found
