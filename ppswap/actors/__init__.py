"""The per-rank actors (compute, copy stream, P2P), their messages, and the runtime."""
