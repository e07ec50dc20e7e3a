"""What an endpoint calls on its data plane for bytes, with the defaults of a plane that has
nothing to add at that point; `TcpPlane`, `DistPlane` and the ipc planes override what they
need.

`send_piece` (sender) or `handle` (either side, for the plane's own messages; False: not
one of them), `on_socket` (receiver: a socket of the plane's own in the IO thread's poller),
`hello_reply` / `hello_problem` / `register_problem` (the handshake's fields and checks of
the plane's own), `registration` (receiver: what the plane adds to `Register`), `registered`
(sender: a peer was accepted), `room_ended` (either side), `forget` (a peer was dropped),
`tick`, `close`. A sender's room: `accept_pages` and `room_attached` (a transfer request),
`release_if_settled`, `carry` and `announce_step` (for a plane whose sender writes the
receiver's pages; such a plane also gives `Sender.destination` its `open_write`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure
from pdserve.protocol.transfer_messages import HelloReply, Register, TransferRequest

if TYPE_CHECKING:
    from pdserve.transfer.peer import Peer


class DataPlane:
    pending_sends = 0  # sends posted and not completed (torch.distributed)

    def handle(self, peer: Peer, msg, payload) -> bool:
        return False

    def on_socket(self, socket) -> bool:
        """Receiver: read `socket` if it is one of the plane's own (True)."""
        return False

    def hello_reply(self, reply: HelloReply) -> HelloReply:
        """Prefill: what the plane adds to `HelloReply`."""
        return reply

    def hello_problem(self, peer: Peer, msg: HelloReply) -> str | None:
        """Decode: why the prefill worker that answered cannot be our peer, if it cannot."""
        return None

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        """Prefill: why a decode worker cannot register, if it cannot."""
        return None

    def registration(self, peer: Peer, register: Register) -> Register:
        return register

    def registered(self, peer: Peer, msg: Register) -> None:
        pass

    def room_ended(self, room) -> None:
        pass

    def accept_pages(self, peer: Peer, msg: TransferRequest) -> object | Failure:
        """Sender: what the plane keeps of a transfer request (`room_attached` gets it), or
        why the request is refused (a plane whose sender writes decode's pages checks their
        ids)."""
        return None

    def room_attached(self, room, accepted: object) -> None:
        """Sender: `room` becomes the peer's, with what `accept_pages` returned (called just
        before it is attached: the worker's thread may use it from then on)."""

    def release_if_settled(self, peer: Peer, room_id: int) -> None:
        """Sender: `peer` asked about a room that ended here; a plane whose sender writes the
        receiver's pages tells it once none of its writes is in flight."""

    def carry(self, peer: Peer, msg, payload: tuple) -> bool | None:
        """Sender, any thread: send `msg` another way than the control connection (True:
        sent); None: not the plane's to carry."""
        return None

    def announce_step(self, room, step) -> bool:
        """Sender, the worker's thread: run a room's step with no piece (`Sender.finish`) in
        order with the pieces the plane announced itself; False: not such a plane (the
        server submits the step)."""
        return False

    def pages_settled(self, room) -> bool:
        """Receiver (under the endpoint's lock): no write of the sender's into `room`'s pages
        can still land (only a plane whose sender writes them says otherwise)."""
        return True

    def admit_request(self, peer: Peer, room) -> bool:
        """Receiver (under the endpoint's lock): the transfer request for `room` (None: the
        room was forgotten) is about to go to `peer`; False: it must not go (a plane whose
        sender writes the room's pages records that writer here)."""
        return True

    def writes_pending(self, room, by: Peer | None = None) -> bool:
        """Receiver (under the endpoint's lock): the sender (`by`, if given) was asked for
        `room` and may write its pages, and has not said its writes are over."""
        return False

    def writes_released(self, peer: Peer, room) -> bool:
        """Receiver (under the endpoint's lock): `peer` said its writes into `room`'s pages
        are over; False if it is not the sender that may write them (the word is ignored)."""
        return False

    def room_forgotten(self, room) -> None:
        """Receiver (under the endpoint's lock): the endpoint forgot `room` (released, and no
        write of the sender's pending): drop what the plane keeps for it."""

    def forget(self, peer: Peer) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass
