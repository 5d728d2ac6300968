"""systemd notifications (Type=notify): READY=1, WATCHDOG=1, STOPPING=1, STATUS=... ."""

from __future__ import annotations

import os
import socket


class SystemdNotifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec and usec.isdigit() else None

    def notify(self, message: str) -> bool:
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                # Never block: a notify socket nobody reads (its queue full) must not freeze the
                # main loop, which also handles SIGHUP and SIGTERM. A dropped message is harmless.
                sock.setblocking(False)
                sock.connect(addr)
                sock.send(message.encode())
            return True
        except OSError:  # including BlockingIOError when the receiver's queue is full
            return False

    def ready(self) -> bool:
        return self.notify("READY=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")
