"""writing: see ARCHITECTURE.md."""
