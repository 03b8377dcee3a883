"""urls: see ARCHITECTURE.md."""
