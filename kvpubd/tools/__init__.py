"""Tools built on the client library and the daemon: ``bench``, ``demo``, ``loadgen``, and the
``launcher`` that runs a daemon as a child process."""
