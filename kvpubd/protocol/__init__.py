"""What daemon and clients share: the wire format of events (``wire``), the block hash chain
(``hashing``), the control protocol (``control``), configuration and endpoints (``config``) and
CURVE keys (``auth``). It imports neither side."""
