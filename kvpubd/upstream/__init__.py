"""Following an unmodified engine's own KV-event publisher: its payloads decoded into kvpubd's
canonical events (``flavours``), and one rank's stream followed in order, gaps repaired through
the engine's replay socket and restarts detected (``follower``)."""
