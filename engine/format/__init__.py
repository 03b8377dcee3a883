"""format: see ARCHITECTURE.md."""
