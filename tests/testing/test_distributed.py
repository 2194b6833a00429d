import socket

from diffulex.testing.distributed import free_ports


def test_free_ports_returns_the_first_of_a_run_where_every_port_can_be_bound() -> None:
    first = free_ports(4)
    sockets = [socket.socket() for _ in range(4)]
    try:
        for offset, sock in enumerate(sockets):
            sock.bind(("127.0.0.1", first + offset))
    finally:
        for sock in sockets:
            sock.close()
