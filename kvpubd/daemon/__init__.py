"""The daemon, in the order data flows through it: the control server (``control_server``)
hands parsed requests to ``service``, which owns one rank pipeline (``pipeline``) per
data-parallel rank; a pipeline owns the rank's cache (``cache``: block ``pool`` + ``radix``
index), its event ``sink`` and its ``publisher``: the ``history`` of what was published (seqs,
the ring of sent batches) and how it travels (``transports``: ZeroMQ PUB + replay ROUTER).
``metrics``, ``notify`` (systemd) and ``reaper`` serve the lifecycle. It never imports the
client library or the tools."""
