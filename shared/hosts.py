"""Addresses a process announces through Redis for processes on other machines to dial (TP
rank 0's rendezvous, a P/D worker's KV session), each announced with the name of the machine
it runs on (`this_host()`).

A loopback address reaches only the machine that dials it: announced on one machine and
dialed from another, it leads the dialer into itself, where nothing (or something else)
listens. `loopback_elsewhere` says so, in one line naming the flag that sets the address.
"""
from __future__ import annotations

import ipaddress
import socket


def this_host() -> str:
    """The name of this machine, as announcements carry it."""
    return socket.gethostname()


def loopback_elsewhere(addr: str, announced_on: str | None, dialed_from: str | None,
                       who: str, flag: str) -> str:
    """Why `addr`, announced by `who` on machine `announced_on`, cannot be dialed from
    machine `dialed_from` ("" if it can, as far as is known): a loopback address of another
    machine. Unknown machines (an announcement without one) and host names (whether a name
    is that machine is DNS's say) pass."""
    if announced_on is None or dialed_from is None or announced_on == dialed_from:
        return ""
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return ""
    if not loopback:
        return ""
    return (f"{who} runs on {announced_on} and announced {addr}, a loopback address, which "
            f"{dialed_from} (another machine) dials into itself: start it with {flag} set to "
            f"an address of {announced_on} that {dialed_from} reaches")
