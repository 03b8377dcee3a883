"""io: see ARCHITECTURE.md."""
