"""planning: see ARCHITECTURE.md."""
