"""apps: see ARCHITECTURE.md."""
