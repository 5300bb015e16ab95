"""The node agent's state keeper: agents' hot/warm/cold state (docs/state.md)."""
