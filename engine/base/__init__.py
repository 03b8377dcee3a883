"""base: see ARCHITECTURE.md."""
