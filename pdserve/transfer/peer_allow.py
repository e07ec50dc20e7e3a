"""Which prefill workers a decode worker may contact. Torch-free.

A request names its prefill worker (`bootstrap_host`), so without a check anyone who can send
a request could make a decode worker open connections wherever they like. A decode worker
only contacts addresses inside its allow list: `--bootstrap-allow` (addresses and CIDRs), by
default loopback plus the networks this host is directly attached to (Linux: the connected
routes of /proc/net/route and the prefixes of /proc/net/if_inet6) and the network of its own
bootstrap address (a /24, or a /64 for IPv6). Across routed networks (e.g. Kubernetes pods on
several nodes) give the pod CIDR explicitly. A host name is resolved once, the address is
checked, and that address (never the name again) is what we connect to.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from pathlib import Path

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_HOST_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+")
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class PeerNotAllowed(ValueError):
    """A request names a prefill worker outside this decode worker's allow list."""


def parse_allow_list(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDRs ("10.0.0.0/8", "192.168.1.7", "fd00::/8"); ValueError names a bad one."""
    networks = []
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(
                f"--bootstrap-allow entry {text!r} is not an IP address or CIDR network"
            ) from None
    return tuple(networks)


def default_allow_list(own_host: str) -> tuple[Network, ...]:
    """Loopback, the host's directly attached networks, and its bootstrap address's network."""
    networks = [*LOOPBACK, *_connected_networks()]
    try:
        own = ipaddress.ip_address(own_host)
    except ValueError:
        own = None
    if own is not None and not own.is_loopback and not own.is_unspecified:
        prefix = 24 if own.version == 4 else 64
        networks.append(ipaddress.ip_network(f"{own}/{prefix}", strict=False))
    return tuple(dict.fromkeys(networks))


class PeerAllowList:
    def __init__(self, networks: tuple[Network, ...]):
        self.networks = networks

    def resolve(self, host: str) -> str:
        """The address to connect to for `host`; PeerNotAllowed if it is outside the list."""
        address = _resolve(host)
        if not any(address in network for network in self.networks):
            raise PeerNotAllowed(
                f"bootstrap_host {host!r} ({address}) is not an allowed prefill address "
                "(see the decode worker's --bootstrap-allow)"
            )
        return str(address)


def zmq_endpoint(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host):
        raise PeerNotAllowed(f"bootstrap_host {host[:64]!r} is not an IP address or a host name")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise PeerNotAllowed(f"bootstrap_host {host!r} does not resolve: {e}") from None
    # NOTE: IPv4 first when both families answer, as the router's discovery does.
    addresses = sorted({info[4][0] for info in infos}, key=lambda a: ":" in a)
    if not addresses:
        raise PeerNotAllowed(f"bootstrap_host {host!r} does not resolve")
    return ipaddress.ip_address(addresses[0].split("%")[0])


def _connected_networks() -> list[Network]:
    return [*_ipv4_connected(), *_ipv6_prefixes()]


def _ipv4_connected() -> list[Network]:
    """Routes without a gateway in /proc/net/route: the networks on our own links."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or fields[2] != "00000000" or fields[1] == "00000000":
            continue
        destination = ipaddress.IPv4Address(int(fields[1], 16).to_bytes(4, "little"))
        mask = ipaddress.IPv4Address(int(fields[7], 16).to_bytes(4, "little"))
        try:
            found.append(ipaddress.ip_network(f"{destination}/{mask}", strict=False))
        except ValueError:
            continue
    return found


def _ipv6_prefixes() -> list[Network]:
    """Our IPv6 addresses with their prefix lengths (/proc/net/if_inet6), link-local excepted."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        try:
            address = ipaddress.IPv6Address(int(fields[0], 16))
            network = ipaddress.ip_network(f"{address}/{int(fields[2], 16)}", strict=False)
        except ValueError:
            continue
        if not address.is_link_local:
            found.append(network)
    return found
