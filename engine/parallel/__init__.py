"""parallel: see ARCHITECTURE.md."""
