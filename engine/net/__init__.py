"""net: see ARCHITECTURE.md."""
