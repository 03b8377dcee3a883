"""loading: see ARCHITECTURE.md."""
