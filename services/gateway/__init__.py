"""The gateway process: client APIs over a token-level generation backend."""
