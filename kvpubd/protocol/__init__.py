"""What daemon and clients share: the wire format of events (``wire``), the block hash chain
(``hashing``), the control protocol (``control``, ``control_frames``, ``int_arrays``),
endpoints (``endpoints``) and CURVE key files (``auth``). It imports neither side, nor what
only the daemon runs (its settings, its CURVE server)."""
