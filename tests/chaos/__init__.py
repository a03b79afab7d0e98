"""The chaos harness: a private PostgreSQL cluster, a misbehaving receiver, a driver that
kills and restarts the real commands, and the drain-and-count ledger (docs/reliability.md)."""
