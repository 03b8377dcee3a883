"""commands: see ARCHITECTURE.md."""
